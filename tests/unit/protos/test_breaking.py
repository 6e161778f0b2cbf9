"""specsplit.v1 keeps the wire of its published baseline; the check names every field a change would break."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "protos"))
try:
    import breaking
finally:
    sys.path.pop(0)

BASELINE = breaking.descriptors(breaking.BASELINE_ROOT)


def edited(tmp_path: Path, old: str, new: str, count: int = 1) -> list[str]:
    """The breaks of the current contract with ``old`` replaced by ``new`` (which must occur ``count`` times)."""
    text = (breaking.PROTO_ROOT / breaking.CONTRACT).read_text()
    assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times"
    root = tmp_path / "protos"
    (root / breaking.CONTRACT).parent.mkdir(parents=True, exist_ok=True)
    (root / breaking.CONTRACT).write_text(text.replace(old, new))
    return breaking.breaking_changes(BASELINE, breaking.descriptors(root))


def test_the_contract_keeps_its_baseline():
    result = subprocess.run(
        [sys.executable, "protos/breaking.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_an_unchanged_copy_passes(tmp_path):
    """The control for the cases below: the copy itself breaks nothing."""
    assert edited(tmp_path, "syntax = ", "syntax = ") == []


def test_a_renumbered_field_is_named(tmp_path):
    breaks = edited(tmp_path, "optional uint32 max_new_tokens = 3;", "optional uint32 max_new_tokens = 99;")
    assert breaks == ["specsplit.v1.GenerateRequest.max_new_tokens (3): renumbered 3 -> 99"]


def test_two_swapped_numbers_are_both_named(tmp_path):
    text = (breaking.PROTO_ROOT / breaking.CONTRACT).read_text()
    swapped = re.sub(r"(FinishReason finish_reason = )3;(\s+(?://.*\n\s+)*GenerationStats stats = )4;", r"\g<1>4;\g<2>3;", text)
    assert swapped != text
    breaks = edited(tmp_path, text, swapped)
    assert "specsplit.v1.GenerateResponse.finish_reason (3): renumbered 3 -> 4 (number 3 is now stats)" in breaks
    assert "specsplit.v1.GenerateResponse.stats (4): type specsplit.v1.GenerationStats -> specsplit.v1.FinishReason" in breaks


def test_a_retyped_field_is_named(tmp_path):
    breaks = edited(tmp_path, "uint32 prompt_tokens = 1;", "uint64 prompt_tokens = 1;")
    assert breaks == ["specsplit.v1.GenerationStats.prompt_tokens (1): type uint32 -> uint64"]


def test_a_field_made_repeated_is_named(tmp_path):
    breaks = edited(tmp_path, "uint32 new_tokens = 2;", "repeated uint32 new_tokens = 2;")
    assert breaks == ["specsplit.v1.GenerationStats.new_tokens (2): singular -> repeated"]


def test_a_removed_field_must_leave_its_number_and_name_reserved(tmp_path):
    text = (breaking.PROTO_ROOT / breaking.CONTRACT).read_text()
    line = re.search(r"\n  string request_id = 183;\n", text).group(0)
    assert edited(tmp_path, line, "\n") == [
        'specsplit.v1.GenerateRequest.request_id (183): field removed without reserved 183; reserved "request_id";'
    ]
    assert edited(tmp_path, line, '\n  reserved 183;\n  reserved "request_id";\n') == []


def test_a_dropped_reservation_is_named(tmp_path):
    breaks = edited(tmp_path, "reserved 4, 16, 18;", "reserved 4, 18;")
    assert breaks == ["specsplit.v1.DraftBlock.service_us (16): field removed without reserved 16;"]


def test_a_removed_enum_value_is_named(tmp_path):
    breaks = edited(tmp_path, "  DRAFTER_KIND_EAGLE = 6;\n", "")
    assert breaks == [
        'specsplit.v1.DrafterKind.DRAFTER_KIND_EAGLE (6): value removed without reserved 6; reserved "DRAFTER_KIND_EAGLE";'
    ]


def test_a_removed_or_reshaped_rpc_is_named(tmp_path):
    rpc = "rpc Generate(GenerateRequest) returns (stream GenerateResponse);"
    assert edited(tmp_path, rpc, "") == ["specsplit.v1.Generator.Generate: RPC removed"]
    unary = "rpc Generate(GenerateRequest) returns (GenerateResponse);"
    assert edited(tmp_path, rpc, unary) == ["specsplit.v1.Generator.Generate: server_streaming True -> False"]


def test_renaming_a_message_or_field_keeps_the_wire(tmp_path):
    """Names do not travel: a rename passes, and its fields are still compared through the field that carries it."""
    text = (breaking.PROTO_ROOT / breaking.CONTRACT).read_text()
    renamed = re.sub(r"\bSecondGuess\b", "Runnerup", text).replace("second_guess = 17", "runner_up = 17")
    assert edited(tmp_path, text, renamed) == []
    moved = renamed.replace("  int32 token = 2;\n}", "  int32 token = 3;\n}", 1)
    assert moved != renamed
    assert edited(tmp_path, text, moved) == ["specsplit.v1.DraftBranch.token (2): renumbered 2 -> 3"]


def test_the_cli_fails_and_names_the_field(tmp_path):
    root = tmp_path / "protos"
    shutil.copytree(breaking.PROTO_ROOT / "specsplit", root / "specsplit")
    contract = root / breaking.CONTRACT
    contract.write_text(contract.read_text().replace("GenerationStats stats = 4;", "GenerationStats stats = 98;"))
    result = subprocess.run(
        [sys.executable, "protos/breaking.py", "--proto-root", str(root)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "specsplit.v1.GenerateResponse.stats (4): renumbered 4 -> 98" in result.stderr
