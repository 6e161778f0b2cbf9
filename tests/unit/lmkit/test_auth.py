"""Token files: parsed per line, re-read when they change, a removed token kept for the grace window."""

from __future__ import annotations

import pytest

from specsplit.lmkit.auth import Tokens

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_named_and_unnamed_tokens_identify_their_callers(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# orchestrators\nalice s3cret-a\n\ns3cret-b\n")
    tokens = Tokens(path=str(path))
    assert tokens.caller("s3cret-a") == "alice"
    assert tokens.caller("s3cret-b").startswith("token:") and len(tokens.caller("s3cret-b")) == len("token:") + 8
    assert tokens.caller("s3cret") is None and tokens.caller("") is None
    assert tokens.first() == "s3cret-a"


def test_a_rotated_file_takes_effect_and_the_old_token_lasts_the_grace_window(tmp_path):
    path, clock = tmp_path / "tokens", Clock()
    path.write_text("old-token\n")
    tokens = Tokens(path=str(path), grace_s=30.0, clock=clock)
    assert tokens.caller("new-token") is None
    path.write_text("new-token\n")  # same size, likely the same mtime tick: the once-a-second read sees it
    clock.now += 1.0
    assert tokens.caller("new-token") is not None and tokens.first() == "new-token"
    clock.now += 29.0
    assert tokens.caller("old-token") is not None  # clients that have not seen the new file yet
    clock.now += 2.0
    assert tokens.caller("old-token") is None


def test_an_unreadable_rewrite_keeps_the_current_tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("kept\n")
    tokens = Tokens(path=str(path))
    path.write_text("\n# nothing\n")
    assert tokens.caller("kept") is not None
    path.unlink()
    assert tokens.caller("kept") is not None


@pytest.mark.parametrize("text,match", [("", "holds no token"), ("a b c\n", "NAME TOKEN")])
def test_bad_files_are_refused_at_start(tmp_path, text, match):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Tokens(path=str(path))
    with pytest.raises(ValueError, match="No such file"):
        Tokens(path=str(tmp_path / "missing"))


def test_the_environment_form(monkeypatch):
    monkeypatch.delenv("SPECSPLIT_TEST_TOKEN", raising=False)
    assert Tokens.load("", "SPECSPLIT_TEST_TOKEN") is None
    monkeypatch.setenv("SPECSPLIT_TEST_TOKEN", "from-env")
    assert Tokens.load("", "SPECSPLIT_TEST_TOKEN").caller("from-env") is not None
