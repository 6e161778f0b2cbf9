"""Check ``specsplit.v1`` against its baseline: every change a peer built from the baseline would misread.

    python protos/breaking.py                      # protos/ against protos/baseline/
    python protos/breaking.py --against DIR        # against another tree of .proto files

The rules are the wire's (buf's WIRE category): a field keeps its number, type, label and oneof; a removed
field leaves its number and name reserved; a reserved number stays reserved; an enum value keeps its number;
an RPC keeps its name, request and response types and streaming. Messages are matched by name, or through
the field or RPC that carries them, so renaming a message or a field is allowed (names do not travel).
Exit status 1, with one line per break naming the field, when anything breaks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
BASELINE_ROOT = PROTO_ROOT / "baseline"
CONTRACT = "specsplit/v1/specsplit.proto"

FieldProto = descriptor_pb2.FieldDescriptorProto


def descriptors(proto_root: Path, name: str = CONTRACT) -> descriptor_pb2.FileDescriptorProto:
    """Compile ``proto_root / name`` with protoc and return its descriptor."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        args = ["grpc_tools.protoc", f"--proto_path={proto_root}", f"--descriptor_set_out={out}", name]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto_root / name}; see the message above")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def _index(file: descriptor_pb2.FileDescriptorProto) -> tuple[dict, dict]:
    """Messages and enums by fully qualified name ('.specsplit.v1.X.Y', as type_name spells them)."""
    messages, enums = {}, {}

    def walk(prefix, message_types, enum_types):
        for enum in enum_types:
            enums[f"{prefix}.{enum.name}"] = enum
        for message in message_types:
            name = f"{prefix}.{message.name}"
            messages[name] = message
            walk(name, message.nested_type, message.enum_type)

    walk(f".{file.package}", file.message_type, file.enum_type)
    return messages, enums


def _reserved(descriptor, number: int) -> bool:
    return any(r.start <= number < r.end for r in descriptor.reserved_range)  # end is exclusive in descriptors


def _label(field) -> str:
    if field.label == FieldProto.LABEL_REPEATED:
        return "repeated"
    return "singular"  # proto3 `optional` adds presence, not a different encoding


def _type(field) -> str:
    return field.type_name[1:] if field.type_name else FieldProto.Type.Name(field.type).removeprefix("TYPE_").lower()


class _Comparison:
    """A walk over baseline/current pairs of messages and enums, collecting breaks."""

    def __init__(self, baseline, current) -> None:
        self.baseline_messages, self.baseline_enums = _index(baseline)
        self.current_messages, self.current_enums = _index(current)
        self.pairs: dict[str, str] = {}  # baseline type name -> the current type it pairs with
        self.breaks: list[str] = []

    def pair(self, old: str, new: str, where: str) -> None:
        """Pair two types (message or enum) that the same place carries; compare them once."""
        if old in self.pairs:
            if self.pairs[old] != new:
                self.breaks.append(f"{where}: now carries {new[1:]}, which is not the {old[1:]} it carried")
            return
        self.pairs[old] = new
        if old in self.baseline_enums:
            self.compare_enum(old, new)
        else:
            self.compare_message(old, new)

    def compare_message(self, old_name: str, new_name: str) -> None:
        old, new = self.baseline_messages[old_name], self.current_messages.get(new_name)
        if new is None:
            self.breaks.append(f"{old_name[1:]}: message removed")
            return
        fields = {f.number: f for f in new.field}
        for field in old.field:
            where = f"{old_name[1:]}.{field.name} ({field.number})"
            now = fields.get(field.number)
            moved = next((f for f in new.field if f.name == field.name), None)
            if now is None and moved is not None:
                self.breaks.append(f"{where}: renumbered {field.number} -> {moved.number}")
            elif now is None:
                self.check_removed(where, field, new, what="field")
            else:
                self.compare_field(where, field, now, old, new)
        for r in old.reserved_range:
            for number in range(r.start, r.end):
                if number in fields:
                    self.breaks.append(f"{old_name[1:]}: reserved number {number} is now {fields[number].name}")

    def check_removed(self, where: str, field, new, what: str) -> None:
        missing = []
        if not _reserved(new, field.number):
            missing.append(f"reserved {field.number};")
        if field.name not in new.reserved_name:
            missing.append(f'reserved "{field.name}";')
        if missing:
            self.breaks.append(f"{where}: {what} removed without {' '.join(missing)}")

    def compare_field(self, where: str, old, new, old_message, new_message) -> None:
        moved = next((f for f in new_message.field if f.name == old.name), None)
        if old.name != new.name and moved is not None:
            self.breaks.append(f"{where}: renumbered {old.number} -> {moved.number} (number {old.number} is now {new.name})")
        renamed_type = old.type_name not in self.current_messages and old.type_name not in self.current_enums
        if old.type != new.type or (old.type_name != new.type_name and not renamed_type):
            self.breaks.append(f"{where}: type {_type(old)} -> {_type(new)}")
        elif old.type_name:
            self.pair(old.type_name, new.type_name, where)
        if _label(old) != _label(new):
            self.breaks.append(f"{where}: {_label(old)} -> {_label(new)}")
        old_oneof = _oneof(old, old_message)
        new_oneof = _oneof(new, new_message)
        if (old_oneof is None) != (new_oneof is None):
            self.breaks.append(f"{where}: oneof {old_oneof or '(none)'} -> {new_oneof or '(none)'}")

    def compare_enum(self, old_name: str, new_name: str) -> None:
        old, new = self.baseline_enums[old_name], self.current_enums.get(new_name)
        if new is None:
            self.breaks.append(f"{old_name[1:]}: enum removed")
            return
        numbers = {v.number for v in new.value}
        for value in old.value:
            if value.number not in numbers:
                self.check_removed(f"{old_name[1:]}.{value.name} ({value.number})", value, new, what="value")

    def compare_services(self, baseline, current) -> None:
        services = {s.name: s for s in current.service}
        for service in baseline.service:
            now = services.get(service.name)
            if now is None:
                self.breaks.append(f"{baseline.package}.{service.name}: service removed")
                continue
            methods = {m.name: m for m in now.method}
            for method in service.method:
                where = f"{baseline.package}.{service.name}.{method.name}"
                m = methods.get(method.name)
                if m is None:
                    self.breaks.append(f"{where}: RPC removed")
                    continue
                for side in ("client_streaming", "server_streaming"):
                    if getattr(method, side) != getattr(m, side):
                        self.breaks.append(f"{where}: {side} {getattr(method, side)} -> {getattr(m, side)}")
                self.pair(method.input_type, m.input_type, f"{where} request")
                self.pair(method.output_type, m.output_type, f"{where} response")

    def compare_unreached(self) -> None:
        """Types no RPC reaches are matched by name."""
        for name in [*self.baseline_messages, *self.baseline_enums]:
            if name not in self.pairs:
                self.pair(name, name, name[1:])


def _oneof(field, message) -> str | None:
    if not field.HasField("oneof_index") or field.proto3_optional:
        return None
    return message.oneof_decl[field.oneof_index].name


def breaking_changes(baseline: descriptor_pb2.FileDescriptorProto,
                     current: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Every change of ``current`` that a peer built from ``baseline`` would misread; [] when none."""
    if baseline.package != current.package:
        return [f"package {baseline.package} -> {current.package}"]
    comparison = _Comparison(baseline, current)
    comparison.compare_services(baseline, current)
    comparison.compare_unreached()
    return comparison.breaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, default=BASELINE_ROOT, help="root of the baseline .proto files")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT, help="root of the current .proto files")
    args = parser.parse_args(argv)
    breaks = breaking_changes(descriptors(args.against), descriptors(args.proto_root))
    if breaks:
        print(f"{len(breaks)} breaking change(s) to {CONTRACT} against {args.against}:", file=sys.stderr)
        for line in breaks:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{CONTRACT} keeps every field, value and RPC of {args.against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
