"""Training data for an EAGLE head, from the target itself: its features and next-token choices on text.

Two sources, both run through the target teacher-forced (one forward per batch):

* a local corpus: Python's own documentation (``pydoc_data.topics``), the
  standard library's sources, and ``/usr/share/doc/python3.11`` when present;
* the target's own answers to a pool of chat prompts, greedy and sampled,
  generated in batches: a head drafts the target's answers, so these matter
  most (EAGLE trains on the target's own outputs, Li et al. 2024, §4).

Per position the data keeps the target's features of the chosen layers (fp16),
its final normed hidden state (fp16; the head's soft targets are recomputed
from it over the draft vocabulary) and its argmax. Sequences are kept apart
(``Segments``): a training window never spans two.
"""

from __future__ import annotations

import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specsplit.draft_service.corpus import read_corpus

# Chat prompts: templates x subjects. The benchmarks' prompts (bench/prompts.py, bench/prompt_sets/) are not
# among them: no lighthouse keeper, blue sky, guitar, painting robot, tides, garden party, cats and dogs,
# seasons, palindromes, merging sorted lists or word counts.
_TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} in simple words.",
    "Give three interesting facts about {}.",
    "Describe {} in one paragraph.",
    "Write a poem about {}.",
    "What are the advantages and disadvantages of {}?",
    "How would you explain {} to a child?",
    "Write a short blog post about {}.",
    "List five questions a student might ask about {}.",
    "Write a friendly email to a colleague about {}.",
    "Summarise the history of {} in a few sentences.",
    "Give some practical advice about {}.",
    "Write a dialogue between two friends talking about {}.",
    "Why do people care about {}?",
    "Write a product description for something related to {}.",
    "What is the most common misconception about {}?",
    "Write a diary entry about a day spent with {}.",
    "Compare {} with something similar and explain the difference.",
    "Write the opening paragraph of a novel that involves {}.",
    "Give a step-by-step guide to getting started with {}.",
)
_SUBJECTS = (
    "a dragon who is afraid of heights", "the moon", "volcanoes", "honeybees", "a small bakery", "the ocean floor",
    "winter in the mountains", "a lost umbrella", "trains", "the first day at a new school", "rainforests",
    "a talking cat", "recycling", "the history of chess", "a haunted library", "photosynthesis", "electric cars",
    "a friendly ghost", "the water cycle", "an old clock", "desert animals", "a space station", "baking bread",
    "a detective in Venice", "the printing press", "learning a new language", "a city at night", "gardening",
    "the human heart", "a treasure map", "penguins", "public libraries", "a marathon runner", "the Roman Empire",
    "a time traveller", "coffee", "the northern lights", "a village festival", "earthquakes", "friendship",
    "a robot vacuum cleaner", "the stock market", "a lonely astronaut", "solar panels", "an ancient forest",
    "the invention of the telephone", "a chef who cannot taste", "owls", "climate change", "a secret garden",
    "mathematics", "a knight and a wizard", "the Great Wall of China", "kindness", "a mysterious island",
    "video games", "a circus elephant", "the immune system", "a snowstorm", "volunteering", "the Internet",
    "a pirate ship", "healthy sleep", "the Olympic Games", "a bicycle trip", "black holes", "a fox in the city",
    "the French Revolution", "dinosaurs", "a music teacher", "writing a résumé", "the Amazon river", "tea",
    "a broken robot", "saving money", "the pyramids of Egypt", "a dog who wants to fly", "wind turbines",
    "a rainy afternoon", "the theory of evolution", "a magic paintbrush", "running a small business",
    "jellyfish", "a family road trip", "vaccines", "a shy giant", "public speaking", "the solar system",
    "an abandoned castle", "making friends as an adult", "the Renaissance", "a clockmaker's apprentice",
    "artificial intelligence", "a wolf pack", "cooking pasta", "the Arctic", "a lost letter", "meditation",
    "the Industrial Revolution", "a young inventor", "birds migrating", "a storm at sea", "time management",
    "the history of writing", "a bakery competition", "octopuses", "a mountain village", "Python programming",
    "sorting algorithms", "databases", "unit testing", "version control with git", "recursion", "web servers",
    "the binary number system", "encryption", "a debugging session", "open source software",
)
_CODE_TASKS = (
    "Write a Python function that {}.",
    "Explain how to write a Python program that {}.",
)
_CODE_SUBJECTS = (
    "reverses a string", "checks whether a number is prime", "finds the largest value in a dictionary",
    "reads a CSV file and prints each row", "computes a factorial", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "computes the average of a list of numbers", "flattens a nested list",
    "counts vowels in a sentence", "returns the n-th Fibonacci number", "sorts a list of tuples by their second item",
    "validates an email address",
)


def prompt_pool(count: int, seed: int) -> list[str]:
    """``count`` distinct chat prompts, in a seeded order."""
    pool = [t.format(s) for t in _TEMPLATES for s in _SUBJECTS] + [t.format(s) for t in _CODE_TASKS for s in _CODE_SUBJECTS]
    random.Random(seed).shuffle(pool)
    if count > len(pool):
        raise ValueError(f"--prompts {count}: the pool has {len(pool)} prompts")
    return pool[:count]


def corpus_documents(paths: Sequence[str] = ()) -> list[str]:
    """The local corpus: given files/folders, or Python's documentation and standard library sources."""
    if paths:
        return [read_corpus(tuple(paths))]
    from pydoc_data.topics import topics

    documents = [topics[key] for key in sorted(topics)]
    docs = Path("/usr/share/doc/python3.11/html/_sources")
    if docs.is_dir():
        documents += [p.read_text(errors="replace") for p in sorted(docs.rglob("*.txt"))]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents += [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))]
    return documents


def encode_chat(tokenizer, prompt: str) -> list[int]:
    """The prompt as the orchestrator sends it (a user message in the chat template)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def corpus_sequences(tokenizer, documents: list[str], seq_len: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Windows of ``seq_len`` tokens from the documents, shuffled, ``max_tokens`` in all."""
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    windows: list[list[int]] = []
    total = 0
    for i in order:
        ids = tokenizer(documents[i], add_special_tokens=False)["input_ids"]
        for start in range(0, max(len(ids) - seq_len // 2, 1), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 16:
                windows.append(window)
                total += len(window)
        if total >= max_tokens:
            break
    rng.shuffle(windows)
    return windows


def _progress(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


@torch.inference_mode()
def generate_answers(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch: int, temperature: float, seed: int,
    eos_ids: set[int],
) -> list[list[int]]:
    """The target's answers (new tokens only) to tokenized prompts, in left-padded batches; greedy at temperature 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    answers: list[list[int]] = []
    with _progress(len(prompts), "answers (greedy)" if temperature == 0 else f"answers (T={temperature})",
                   "prompt") as bar:
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(len(p) for p in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(group):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            torch.manual_seed(seed + i)
            sampling = dict(do_sample=True, temperature=temperature, top_p=0.95) if temperature > 0 else {"do_sample": False}
            device = model.get_output_embeddings().weight.device
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=sorted(eos_ids), **sampling)
            for row in out[:, width:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
                answers.append(row[:cut])
            bar.update(len(group))
    return answers


@dataclass
class Segments:
    """Sequences run through the target, flattened: positions [starts[i], starts[i+1]) are sequence i."""

    tokens: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, F] float16: the chosen layers' hidden states
    final: torch.Tensor  # [N, H] float16: the final normed hidden state (logits = lm_head(final))
    argmax: torch.Tensor  # [N] int64: the target's greedy next token at each position
    starts: torch.Tensor  # [S + 1] int64
    answer_from: torch.Tensor  # [S] int64: first position of the target's own answer in each sequence (0: corpus)

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> torch.Tensor:
        return self.starts[1:] - self.starts[:-1]

    def subset(self, index: Sequence[int]) -> Segments:
        parts = [(int(self.starts[i]), int(self.starts[i + 1])) for i in index]
        take = torch.cat([torch.arange(a, b) for a, b in parts]) if parts else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([b - a for a, b in parts], dtype=torch.long)
        return Segments(
            self.tokens[take], self.features[take], self.final[take], self.argmax[take],
            torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), self.answer_from[list(index)],
        )

    @staticmethod
    def join(parts: Sequence[Segments]) -> Segments:
        offsets, starts = 0, [torch.zeros(1, dtype=torch.long)]
        for part in parts:
            starts.append(part.starts[1:] + offsets)
            offsets += int(part.starts[-1])
        return Segments(
            torch.cat([p.tokens for p in parts]), torch.cat([p.features for p in parts]),
            torch.cat([p.final for p in parts]), torch.cat([p.argmax for p in parts]), torch.cat(starts),
            torch.cat([p.answer_from for p in parts]),
        )

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.__dict__, tmp)
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> Segments:
        return Segments(**torch.load(path, map_location="cpu", weights_only=True))


@torch.inference_mode()
def extract(model, sequences: list[list[int]], answer_from: list[int], layers: Sequence[int], desc: str,
            batch_tokens: int = 2048) -> Segments:
    """Run sequences through the target teacher-forced and keep features, final hidden states and argmaxes (on the
    CPU, whatever device the target runs on)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths share a batch
    head_weight = model.get_output_embeddings().weight
    out_tokens, out_features, out_final, out_argmax = [], [], [], []
    kept: list[int] = []
    with _progress(sum(len(s) for s in sequences), desc, "tok") as bar:
        i = 0
        while i < len(order):
            width = len(sequences[order[i]])
            group = [order[i]]
            while i + len(group) < len(order) and (len(group) + 1) * len(sequences[order[i + len(group)]]) <= batch_tokens:
                group.append(order[i + len(group)])
            width = max(len(sequences[g]) for g in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, g in enumerate(group):
                ids[row, : len(sequences[g])] = torch.tensor(sequences[g])
                mask[row, : len(sequences[g])] = 1
            out = model.model(input_ids=ids.to(head_weight.device), attention_mask=mask.to(head_weight.device),
                              output_hidden_states=True)
            final = out.last_hidden_state  # [B, T, H], normed
            # [B, T, F]; no layers: none (Medusa's heads read the final hidden state alone)
            features = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1) if layers else final[..., :0]
            for row, g in enumerate(group):
                n = len(sequences[g])
                out_tokens.append(ids[row, :n])
                out_features.append(features[row, :n].half().cpu())
                out_final.append(final[row, :n].half().cpu())
                out_argmax.append(torch.cat([(chunk @ head_weight.T).argmax(-1) for chunk in final[row, :n].split(512)]).cpu())
                kept.append(g)
            bar.update(sum(len(sequences[g]) for g in group))
            i += len(group)
    lengths = torch.tensor([len(sequences[g]) for g in kept], dtype=torch.long)
    restore = torch.argsort(torch.tensor(kept))  # back to the given order
    segments = Segments(
        torch.cat(out_tokens), torch.cat(out_features), torch.cat(out_final), torch.cat(out_argmax),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        torch.tensor([answer_from[g] for g in kept], dtype=torch.long),
    )
    return segments.subset(restore.tolist())
