"""A Generate client that runs inside a host (``ip netns exec NS python -m tests.services.host_client``).

    python -m tests.services.host_client ADDRESS REQUESTS.json

REQUESTS.json is a list of ``GenerateRequest`` fields (``json_format``); the requests run one after
another. Prints ``streaming`` once the first response of the first request arrives (a test waits for it
to cut a link mid-generation), then one JSON line: a list of {"ids", "text", "code", "stats"}, one per
request ("stats": the last ``GenerationStats`` sent, field names as in the .proto).
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


async def generate_all(address: str, requests: list[dict]) -> list[dict]:
    results = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for fields in requests:
            ids, text, code, stats = [], [], "OK", {}
            try:
                async for response in stub.Generate(
                    json_format.ParseDict(fields, pb.GenerateRequest()), timeout=TIMEOUT_S
                ):
                    if not results and not ids:
                        print("streaming", flush=True)
                    ids.extend(response.token_ids)
                    text.append(response.text)
                    if response.HasField("stats"):
                        stats = json_format.MessageToDict(response.stats, preserving_proto_field_name=True)
            except grpc.aio.AioRpcError as exc:
                code, text = exc.code().name, [exc.details()]
            results.append({"ids": ids, "text": "".join(text), "code": code, "stats": stats})
    return results


def main() -> None:
    address, path = sys.argv[1:3]
    with open(path) as f:
        requests = json.load(f)
    print(json.dumps(asyncio.run(generate_all(address, requests))), flush=True)


if __name__ == "__main__":
    main()
