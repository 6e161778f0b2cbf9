"""A Generate client that runs inside a host (``ip netns exec NS python -m tests.services.host_client``).

    python -m tests.services.host_client ADDRESS REQUESTS.json [CONCURRENCY]

REQUESTS.json is a list of ``GenerateRequest`` fields (``json_format``); the requests run one after
another, or CONCURRENCY at a time. Prints ``streaming`` once the first response arrives (a test waits for
it to cut a link mid-generation), then one JSON line: a list of {"ids", "text", "code", "stats"}, one per
request in the file's order ("stats": the last ``GenerationStats`` sent, field names as in the .proto).
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
from google.protobuf import json_format

from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

TIMEOUT_S = 300.0


async def generate_all(address: str, requests: list[dict], concurrency: int = 1) -> list[dict]:
    results: list[dict] = [{} for _ in requests]
    streaming = False
    limit = asyncio.Semaphore(concurrency)  # first come, first served: one at a time keeps the file's order

    async def one(stub, i: int, fields: dict) -> None:
        nonlocal streaming
        ids, text, code, stats = [], [], "OK", {}
        async with limit:
            try:
                async for response in stub.Generate(
                    json_format.ParseDict(fields, pb.GenerateRequest()), timeout=TIMEOUT_S
                ):
                    if not streaming:
                        streaming = True
                        print("streaming", flush=True)
                    ids.extend(response.token_ids)
                    text.append(response.text)
                    if response.HasField("stats"):
                        stats = json_format.MessageToDict(response.stats, preserving_proto_field_name=True)
            except grpc.aio.AioRpcError as exc:
                code, text = exc.code().name, [exc.details()]
        results[i] = {"ids": ids, "text": "".join(text), "code": code, "stats": stats}

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        await asyncio.gather(*(one(stub, i, fields) for i, fields in enumerate(requests)))
    return results


def main() -> None:
    address, path = sys.argv[1:3]
    concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with open(path) as f:
        requests = json.load(f)
    print(json.dumps(asyncio.run(generate_all(address, requests, concurrency))), flush=True)


if __name__ == "__main__":
    main()
