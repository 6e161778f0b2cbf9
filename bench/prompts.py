"""Built-in prompts for ``specsplit demo`` and ``specsplit bench``.

The demo's two kinds, reported apart: *grounded* tasks whose answer re-uses the
input (edit code, extract, summarise, answer from a passage) and *open* prose.
The split matters because a model-free drafter only helps where the output
copies from the context.

The mixed-traffic set (``--prompt-set mixed``, ``bench/prompt_sets/mixed.jsonl``)
is what a service sees: 55 prompts of 11 kinds written for the benchmark, each
labelled with its kind, its group (grounded or open) and a dev/held-out split
(``mixed-dev``, ``mixed-heldout``); multi-turn chats carry their message lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SETS_DIR = Path(__file__).parent / "prompt_sets"


@dataclass(frozen=True)
class DemoPrompt:
    name: str
    kind: str  # the demo's "grounded" / "open", or a traffic kind such as "code-edit"
    text: str  # the last user message
    group: str = ""  # "grounded" or "open" for traffic kinds; empty for the demo's sets
    split: str = ""  # "dev" or "heldout" for the mixed set
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of a multi-turn chat; empty: one user message

    def chat(self) -> list[dict[str, str]]:
        """The conversation to put through the chat template."""
        if self.messages:
            return [{"role": role, "content": content} for role, content in self.messages]
        return [{"role": "user", "content": self.text}]


def chat_ids(tokenizer, prompt: DemoPrompt) -> list[int]:
    """The prompt's token ids under the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def load_prompt_set(path: Path) -> tuple[DemoPrompt, ...]:
    """A JSONL prompt set: one object per line with name, kind, group, split and messages."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        messages = tuple((m["role"], m["content"]) for m in row["messages"])
        if not messages or messages[-1][0] != "user":
            raise ValueError(f"{path}:{number}: the last message must be the user's")
        prompts.append(DemoPrompt(
            row["name"], row["kind"], messages[-1][1], row["group"], row["split"],
            messages if len(messages) > 1 else (),
        ))
    return tuple(prompts)


_CODE = '''def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def largest(values):
    best = values[0]
    for v in values:
        if v > best:
            best = v
    return best
'''

_PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps and flows through Switzerland, Liechtenstein, "
    "Austria, Germany, France and the Netherlands before emptying into the North Sea. It is about 1,230 "
    "kilometres long. Major cities on the Rhine include Basel, Strasbourg, Cologne, Düsseldorf and "
    "Rotterdam. The river has been an important shipping route since Roman times, and today barges carry "
    "coal, grain and containers along it."
)

_RECORDS = (
    "Order 1041: customer Ana Lopez, item blue kettle, quantity 2, status shipped.\n"
    "Order 1042: customer Ben Okafor, item steel pan, quantity 1, status pending.\n"
    "Order 1043: customer Chen Wei, item glass jar, quantity 6, status shipped.\n"
    "Order 1044: customer Dana Smith, item wooden spoon, quantity 3, status cancelled.\n"
)

DEMO_PROMPTS: tuple[DemoPrompt, ...] = (
    DemoPrompt(
        "code-edit",
        "grounded",
        "Rename the variable `values` to `numbers` everywhere in this Python code and return the full code:\n\n"
        + _CODE,
    ),
    DemoPrompt(
        "code-docstrings",
        "grounded",
        "Add a one-line docstring to each function in this code. Return the whole code.\n\n" + _CODE,
    ),
    DemoPrompt(
        "extract-table",
        "grounded",
        "Rewrite these records as a Markdown table with columns Order, Customer, Item, Quantity, Status:\n\n"
        + _RECORDS,
    ),
    DemoPrompt(
        "answer-from-text",
        "grounded",
        f"Read the passage and answer: which countries does the Rhine flow through?\n\n{_PASSAGE}",
    ),
    DemoPrompt("summarise", "grounded", f"Summarise this passage in two sentences.\n\n{_PASSAGE}"),
    DemoPrompt("story", "open", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    DemoPrompt("explain", "open", "Explain why the sky is blue to a ten-year-old."),
    DemoPrompt("advice", "open", "Give three tips for learning to play the guitar."),
)


# Drafter comparison (``specsplit bench --prompt-set drafters``): code edits, where the answer copies
# most of its input, against free text, where nothing can be copied and only a model drafter helps.
_PARSER = '''def parse_line(line):
    parts = line.split(",")
    name = parts[0].strip()
    age = int(parts[1])
    city = parts[2].strip()
    return {"name": name, "age": age, "city": city}


def parse_file(path):
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(parse_line(line))
    return rows
'''

CODE_EDIT_PROMPTS: tuple[DemoPrompt, ...] = (
    DemoPrompt(
        "rename-function", "code-edit",
        "Rename the function `parse_line` to `parse_record` everywhere in this code. Return the full code.\n\n"
        + _PARSER,
    ),
    DemoPrompt(
        "add-type-hints", "code-edit",
        "Add Python type hints to every function in this code. Return the full code.\n\n" + _PARSER,
    ),
    DemoPrompt(
        "fix-division", "code-edit",
        "This code crashes on an empty list. Fix `average` so it returns 0 for an empty list and return "
        "the whole code.\n\n" + _CODE,
    ),
    DemoPrompt(
        "loop-to-builtin", "code-edit",
        "Rewrite `largest` to use the built-in max() and `average` to use sum(). Return the whole code.\n\n" + _CODE,
    ),
)

FREE_TEXT_PROMPTS: tuple[DemoPrompt, ...] = (
    DemoPrompt("story-robot", "free-text", "Write a short story about a robot who learns to paint."),
    DemoPrompt("explain-tides", "free-text", "Explain what causes ocean tides, in simple words."),
    DemoPrompt("letter", "free-text", "Write a friendly letter inviting a neighbour to a garden party."),
    DemoPrompt("compare", "free-text", "What are the differences between cats and dogs as pets?"),
)

MIXED_PROMPTS = load_prompt_set(SETS_DIR / "mixed.jsonl")

# Open prose beyond the demo's three, for the EAGLE drafter's figures (``--prompt-set mix``: the demo's
# grounded and open prompts plus these). None is among the chat prompts `specsplit distill --eagle` trains on.
PROSE_PROMPTS: tuple[DemoPrompt, ...] = (
    DemoPrompt("market", "open", "Describe a walk through a busy market on a Saturday morning."),
    DemoPrompt("future-self", "open", "Write a letter to your future self about what you hope to learn this year."),
    DemoPrompt("fridge", "open", "Explain how a refrigerator keeps food cold."),
    DemoPrompt("turtle", "open", "Tell a bedtime story about a turtle who wants to see the sea."),
)

PROMPT_SETS: dict[str, tuple[DemoPrompt, ...]] = {
    "mixed": MIXED_PROMPTS,
    "mixed-dev": tuple(p for p in MIXED_PROMPTS if p.split == "dev"),
    "mixed-heldout": tuple(p for p in MIXED_PROMPTS if p.split == "heldout"),
    "demo": DEMO_PROMPTS,
    "mix": DEMO_PROMPTS + PROSE_PROMPTS,
    "drafters": CODE_EDIT_PROMPTS + FREE_TEXT_PROMPTS,
    "code-edit": CODE_EDIT_PROMPTS,
    "free-text": FREE_TEXT_PROMPTS,
}
