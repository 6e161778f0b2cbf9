"""Training text for the draft's distillation (layer-skip adapters and EAGLE heads): local files, no download."""

from __future__ import annotations

from pathlib import Path

_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}


def read_corpus(paths: tuple[str, ...]) -> str:
    """The training text: the given files/folders, or Python's own documentation (always installed)."""
    if not paths:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    texts = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"--corpus {raw} does not exist; pass text files or folders of them")
        texts += [f.read_text(errors="replace") for f in files]
    text = "\n\n".join(texts)
    if not text.strip():
        raise ValueError(f"--corpus {list(paths)} holds no text (.txt, .md, .rst or .py files)")
    return text
