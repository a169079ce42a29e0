"""A Solana dapp's everyday calls, done with solana-py against one endpoint
(rpc-node --chain solana, or the gateway in front of it), printed as one
JSON document (as solana.mjs prints for @solana/kit and @solana/web3.js),
so that a run through the gateway can be compared with a run straight at
the node.

    python solana_ops.py HTTP_URL WS_URL
    python solana_ops.py overload HTTP_URL   (see overload)

Exits non-zero, with the library's own error, if any call fails.
"""

import asyncio
import json
import sys
import time

from solana.rpc.async_api import AsyncClient
from solana.rpc.commitment import Confirmed
from solana.rpc.websocket_api import SolanaWsClient
from solders.hash import Hash
from solders.keypair import Keypair
from solders.message import MessageV0
from solders.pubkey import Pubkey
from solders.system_program import TransferParams, transfer
from solders.transaction import VersionedTransaction

# The same fixed keys as solana.mjs.
SEED = bytes([7] * 32)
ACCOUNT = Pubkey.from_string("Vote111111111111111111111111111111111111111")
PROGRAM = Pubkey.from_string("TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA")
TIMEOUT_S = 30


def value(response):
    """The JSON-RPC result solders parsed, as JSON again."""
    return json.loads(response.to_json())["result"]


async def first_notifications(ws_url, signature):
    """The first notification of a slot, an account and a signature
    subscription, each on a socket of its own."""

    async def first(subscribe):
        async with SolanaWsClient(ws_url) as ws:
            await subscribe(ws)
            note = await ws.recv()
            return json.loads(note.to_json())["result"]

    return await asyncio.wait_for(
        asyncio.gather(
            first(lambda ws: ws.slot_subscribe()),
            first(lambda ws: ws.account_subscribe(pubkey=ACCOUNT, commitment=Confirmed, encoding="base64")),
            first(lambda ws: ws.signature_subscribe(signature=signature, commitment=Confirmed)),
        ),
        TIMEOUT_S,
    )


async def main(http_url, ws_url):
    client = AsyncClient(http_url, timeout=TIMEOUT_S)
    out = {}
    out["slot"] = value(await client.get_slot(Confirmed))
    out["blockHeight"] = value(await client.get_block_height(Confirmed))
    out["epochInfo"] = value(await client.get_epoch_info())
    out["version"] = value(await client.get_version())
    latest = await client.get_latest_blockhash(Confirmed)
    out["latestBlockhash"] = value(latest)["value"]
    out["balance"] = value(await client.get_balance(ACCOUNT))
    out["accountInfo"] = value(await client.get_account_info(ACCOUNT, encoding="base64"))
    out["multipleAccounts"] = value(await client.get_multiple_accounts([ACCOUNT, PROGRAM], encoding="base64"))
    out["programAccounts"] = value(await client.get_program_accounts(PROGRAM, encoding="base64"))
    out["signaturesForAddress"] = value(await client.get_signatures_for_address(ACCOUNT, commitment=Confirmed))
    finalized = (await client.get_slot()).value
    out["block"] = value(await client.get_block(finalized, max_supported_transaction_version=0))

    payer = Keypair.from_seed(SEED)
    blockhash = Hash.from_string(out["latestBlockhash"]["blockhash"])
    instruction = transfer(TransferParams(from_pubkey=payer.pubkey(), to_pubkey=payer.pubkey(), lamports=1))
    message = MessageV0.try_compile(payer.pubkey(), [instruction], [], blockhash)
    transaction = VersionedTransaction(message, [payer])
    out["simulate"] = value(await client.simulate_transaction(transaction))
    sent = (await client.send_raw_transaction(bytes(transaction))).value
    out["sentSignatureIsTheTransactions"] = sent == transaction.signatures[0]
    out["transaction"] = value(await client.get_transaction(sent, max_supported_transaction_version=0))
    # The loop a wallet runs after sending: statuses until it is confirmed
    # (solana-py gives up after 90 s), then the status it ended on.
    confirmed = await client.confirm_transaction(sent, Confirmed, sleep_seconds=0.2)
    out["confirmed"] = value(confirmed)["value"][0]["confirmationStatus"]
    out["signatureStatuses"] = value(await client.get_signature_statuses([sent]))
    await client.close()

    slot, account, signature = await first_notifications(ws_url, sent)
    out["pubsub"] = {"slot": slot, "account": account, "signature": signature}
    print(json.dumps(out))


async def overload(url):
    """One getBalance against an endpoint that refuses it, with solana-py's
    default retries (none): what the caller is given, and after how long."""
    started = time.monotonic()
    client = AsyncClient(url, timeout=TIMEOUT_S)
    try:
        answer = value(await client.get_balance(ACCOUNT))
        out = {"answer": answer}
    except Exception as error:  # the library's own, whatever it is
        cause = error.__cause__ or error
        response = getattr(cause, "response", None)
        out = {
            "error": f"{type(error).__name__}: {error} ({type(cause).__name__}: {cause})",
            "status": getattr(response, "status_code", None),
            "retryAfter": response.headers.get("retry-after") if response is not None else None,
            "rule": response.headers.get("x-stakegate-rule") if response is not None else None,
        }
    await client.close()
    out["ms"] = round((time.monotonic() - started) * 1000)
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "overload":
        asyncio.run(overload(sys.argv[2]))
    elif len(sys.argv) == 3:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    else:
        sys.exit("usage: python solana_ops.py HTTP_URL WS_URL | overload HTTP_URL")
