"""The everyday operations of a dapp, done with web3.py against one JSON-RPC
endpoint, printed as one JSON document (the same one ops.mjs prints for
viem and ethers), so that a run through the gateway can be compared with a
run straight at the node.

    python ops.py HTTP_URL WS_URL
    python ops.py overload HTTP_URL single|batch|duplicate|slow   (see overload)
    python ops.py burst WS_URL N   (see burst)
    python ops.py final HTTP_URL   (see final_reads)
    python ops.py head HTTP_URL    (see head_reads)

The chain must be anvil's dev chain (its unlocked accounts send the
transaction). Exits non-zero, with web3.py's own error, if any operation
fails.
"""

import asyncio
import json
import sys
import time

from web3 import AsyncWeb3, Web3, WebSocketProvider

# anvil's dev accounts 0 (sender), 1 (receiver) and 9 (never touched).
SENDER = Web3.to_checksum_address("0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266")
RECEIVER = Web3.to_checksum_address("0x70997970c51812dc3a010c7d01b50e20d4dc79c8")
IDLE = Web3.to_checksum_address("0xa0ee7a142d267c1f36714e4a8f75612f20a79720")
# The identity precompile answers a call with its input.
IDENTITY = Web3.to_checksum_address("0x0000000000000000000000000000000000000004")
TIMEOUT_S = 20


def over_http(url):
    w3 = Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": TIMEOUT_S}))
    out = {
        "chainId": w3.eth.chain_id,
        "blockNumber": w3.eth.block_number,
        "balance": str(w3.eth.get_balance(IDLE)),
        "call": "0x" + w3.eth.call({"to": IDENTITY, "data": "0x1234"}).hex(),
    }
    tx = w3.eth.send_transaction({"from": SENDER, "to": RECEIVER, "value": 1})
    receipt = w3.eth.wait_for_transaction_receipt(tx, timeout=TIMEOUT_S, poll_latency=0.05)
    out["transaction"] = {
        "status": "success" if receipt["status"] == 1 else "reverted",
        "blockNumber": receipt["blockNumber"],
    }
    out["logs"] = len(w3.eth.get_logs({"fromBlock": 0, "toBlock": "latest"}))
    with w3.batch_requests() as batch:
        batch.add(w3.eth.chain_id)
        batch.add(w3.eth.block_number)
        chain_id, block_number = batch.execute()
    out["batch"] = [chain_id, block_number]
    return w3, out


async def over_websocket(url, mine):
    async with AsyncWeb3(WebSocketProvider(url)) as w3:
        out = {
            "chainId": await w3.eth.chain_id,
            "blockNumber": await w3.eth.block_number,
            "call": "0x" + (await w3.eth.call({"to": IDENTITY, "data": "0x1234"})).hex(),
        }
        await w3.eth.subscribe("newHeads")
        first = asyncio.ensure_future(w3.socket.process_subscriptions().__anext__())
        # A subscription may not be in place at the node yet when the
        # library says it is: mine until a head arrives (bounded).
        deadline = time.monotonic() + TIMEOUT_S
        while not first.done() and time.monotonic() < deadline:
            mine()
            await asyncio.wait({first}, timeout=0.1)
        if not first.done():
            first.cancel()
            raise TimeoutError(f"newHeads: no head in {TIMEOUT_S} s")
        out["newHead"] = first.result()["result"]["number"] > out["blockNumber"]
        return out


def overload(url, what):
    """One call or one batch of two against an endpoint that refuses it, or
    `eth_getLogs [{}]` while the test keeps the same call in flight (dedup
    holds it for that call's answer), with web3.py's default retries: what
    the caller is finally given, and when. `slow`: an eth_call with a 1 s
    timeout to a node that takes longer, retried by web3.py on each
    timeout (its default for eth_call: five tries, 0.125 s doubling)."""
    timeout = 1 if what == "slow" else TIMEOUT_S
    w3 = Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": timeout}))

    def batch():
        with w3.batch_requests() as b:
            b.add(w3.eth.chain_id)
            b.add(w3.eth.block_number)
            return b.execute()

    started = time.monotonic()
    try:
        result = {
            "single": lambda: w3.eth.block_number,
            "batch": batch,
            "duplicate": lambda: w3.manager.request_blocking("eth_getLogs", [{}]),
            "slow": lambda: "0x" + w3.eth.call({"to": IDENTITY, "data": "0x01"}).hex(),
        }[what]()
        error = None
    except Exception as e:
        result, error = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return {"error": error, "result": str(result), "ms": round((time.monotonic() - started) * 1000)}


async def burst(url, n):
    """N balance reads at once on one WebSocket (`asyncio.gather`), as a
    dapp's page load makes them: how many were answered, the first error,
    and the balances, in order."""
    addresses = [Web3.to_checksum_address(f"0x{i + 1:040x}") for i in range(n)]
    async with AsyncWeb3(WebSocketProvider(url)) as w3:
        started = time.monotonic()
        results = await asyncio.gather(*(w3.eth.get_balance(a) for a in addresses), return_exceptions=True)
        ms = round((time.monotonic() - started) * 1000)
    failed = [r for r in results if isinstance(r, Exception)]
    return {
        "answered": len(results) - len(failed),
        "error": f"{type(failed[0]).__name__}: {failed[0]}".splitlines()[0][:300] if failed else None,
        "balances": [None if isinstance(r, Exception) else str(r) for r in results],
        "ms": ms,
    }


def final_reads(url):
    """What a block explorer or an indexer asks about a final block (the
    block, a balance and a call at it, the logs up to it, the chain id), one
    after another, six times over: the answers, in order, as ops.mjs's
    `final` prints them. The chain must have a finalized block (anvil
    finalises 64 blocks deep)."""
    w3 = Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": TIMEOUT_S}))
    at = w3.eth.get_block("finalized")["number"]
    ask = [
        lambda: w3.to_hex(w3.eth.get_block(at)["hash"]),
        lambda: str(w3.eth.get_balance(SENDER, at)),
        lambda: w3.to_hex(w3.eth.call({"to": IDENTITY, "data": "0x1234"}, at)),
        lambda: len(w3.eth.get_logs({"fromBlock": 0, "toBlock": at})),
        lambda: w3.eth.chain_id,
    ]
    return {"rounds": [[question() for question in ask] for _ in range(6)]}


def head_reads(url):
    """What a wallet asks at the head (the block number, the head block's
    hash, a balance, a nonce and a call at `latest`), one after another, six
    times over: the answers, in order, as ops.mjs's `head` prints them."""
    w3 = Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": TIMEOUT_S}))
    ask = [
        lambda: w3.eth.block_number,
        lambda: w3.to_hex(w3.eth.get_block("latest")["hash"]),
        lambda: str(w3.eth.get_balance(SENDER)),
        lambda: w3.eth.get_transaction_count(SENDER),
        lambda: w3.to_hex(w3.eth.call({"to": IDENTITY, "data": "0x1234"})),
    ]
    return {"rounds": [[question() for question in ask] for _ in range(6)]}


def main():
    if len(sys.argv) == 3 and sys.argv[1] in ("final", "head"):
        reads = final_reads if sys.argv[1] == "final" else head_reads
        print(json.dumps(reads(sys.argv[2])))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "burst":
        print(json.dumps(asyncio.run(burst(sys.argv[2], int(sys.argv[3])))))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "overload":
        print(json.dumps(overload(sys.argv[2], sys.argv[3])))
        return 0
    if len(sys.argv) != 3:
        print("usage: python ops.py HTTP_URL WS_URL, or python ops.py overload HTTP_URL single|batch|duplicate|slow, or python ops.py final|head HTTP_URL", file=sys.stderr)
        return 2
    http_url, ws_url = sys.argv[1:]
    try:
        w3, out = over_http(http_url)
        out["ws"] = asyncio.run(over_websocket(ws_url, lambda: w3.provider.make_request("evm_mine", [])))
    except Exception as e:  # the library's own error is the finding
        print(f"web3.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
