"""``specsplit generate``: streams a completion from a running orchestrator to stdout (no torch, no ray)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import grpc

from specsplit.client import SAMPLING_MODES, AsyncClient, build_request
from specsplit.lmkit.kinds import DrafterKind, drafter_value
from specsplit.lmkit.security import ClientTls
from specsplit.v1 import specsplit_pb2 as pb


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def drafter_arg(text: str) -> int:
    try:
        return drafter_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def logit_bias_arg(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes TOKEN_ID=BIAS, e.g. 50256=-100; got {text!r}") from None


def json_file(path: str) -> str:
    """A JSON file's text, checked to parse (the server checks what it means)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
        json.loads(text)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {exc}") from None
    return text


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--server", default="127.0.0.1:50050", help="orchestrator address")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    parser.add_argument("--max-new-tokens", type=non_negative, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=non_negative, default=0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=non_negative, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="> 0, 1 = off (transformers'); unset: the model's default")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    parser.add_argument("--logit-bias", type=logit_bias_arg, action="append", default=[],
                        help="TOKEN_ID=BIAS, bias in [-100, 100] (repeatable)")
    parser.add_argument("--min-tokens", type=non_negative, default=0, help="no EOS before this many new tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--k", type=non_negative, default=None, help="draft block size; 0 = target-only")
    parser.add_argument("--drafter", type=drafter_arg, default=None,
                        help=f"{', '.join(k.name.lower() for k in DrafterKind)}, or a drafter's number")
    parser.add_argument("--draft-probs", action="store_true", help="probability-mode verification (model drafter)")
    parser.add_argument("--mode", choices=list(SAMPLING_MODES), default=None,
                        help="how sampled tokens are verified (default: the server's; docs/protocol.md, Seeds)")
    parser.add_argument("--n", type=non_negative, default=None,
                        help="samples of the prompt, printed one after another once all are done")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=json_file, default=None, metavar="FILE",
                            help="the output is one JSON value this schema (a JSON file) validates")
    constraint.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    constraint.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    parser.add_argument("--tools", type=json_file, default=None, metavar="FILE",
                        help="OpenAI's tools array (a JSON file) for the chat template")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--token", default="", help="bearer token (or SPECSPLIT_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", default="", help="CA of the orchestrator's certificate (TLS)")
    parser.add_argument("--tls-cert", default="", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", default="", help="client key (mTLS)")
    return parser


def to_request(args) -> pb.GenerateRequest:
    return build_request(
        args.prompt, chat=not args.raw, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, k=args.k, drafter=args.drafter,
        draft_probs=args.draft_probs, mode=args.mode, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias), min_tokens=args.min_tokens, ignore_eos=args.ignore_eos, n=args.n,
        json_schema=args.json_schema, regex=args.regex, choice=args.choice, tools=args.tools,
    )


async def generate(args) -> int:
    token = args.token or os.environ.get("SPECSPLIT_AUTH_TOKEN", "")
    tls = ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    async with AsyncClient(args.server, token=token, tls=tls, timeout_s=args.timeout_s) as client:
        try:
            if (args.n or 1) > 1:  # the samples' messages interleave: print each whole
                samples: dict[int, list[pb.GenerateResponse]] = {}
                async for response in client.stream(to_request(args)):
                    samples.setdefault(response.index, []).append(response)
                for index in sorted(samples):
                    print(f"--- sample {index} ---", file=sys.stderr)
                    sys.stdout.write("".join(r.text for r in samples[index]) + "\n")
                    _report(samples[index][-1])
                return 0
            async for response in client.stream(to_request(args)):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.HasField("stats"):
                    _report(response)
        except grpc.aio.AioRpcError as exc:
            print(f"\nspecsplit generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _report(response: pb.GenerateResponse) -> None:
    s = response.stats
    print(
        f"\n[{pb.FinishReason.Name(response.finish_reason)}] {s.new_tokens} tokens in "
        f"{s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s), acceptance {s.acceptance_rate:.2f}, "
        f"mean accepted length {s.mean_accepted_length:.2f}, seed {s.seed}",
        file=sys.stderr,
    )


def run(args) -> int:
    return asyncio.run(generate(args))
