// A Solana dapp's everyday calls, done with a real client library against
// one endpoint (rpc-node --chain solana, or the gateway in front of it),
// printed as one JSON document, so that a run through the gateway can be
// compared with a run straight at the node.
//
//   node solana.mjs kit|web3js HTTP_URL WS_URL
//   node solana.mjs kit|web3js overload HTTP_URL   (see `overload`)
//   node solana.mjs kit|web3js many HTTP_URL WS_URL N   (see `many`)
//
// Slots, blockhashes and what derives from them move between two runs; the
// test compares the rest exactly and these by shape (see
// tests/real_envoy/solana.rs). Exits non-zero, with the library's own
// error, if any call fails.

import * as kit from "@solana/kit";
import * as web3 from "@solana/web3.js";

const [library, httpUrl, wsUrl] = process.argv.slice(2);
// Fixed keys, so that both runs ask about the same accounts.
const SEED = new Uint8Array(32).fill(7);
const ACCOUNT = "Vote111111111111111111111111111111111111111";
const PROGRAM = "TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA";
const TIMEOUT_MS = 30_000;

function within(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${TIMEOUT_MS} ms`)), TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// The loop a wallet runs after sending: the signature's status, every
// 100 ms, until it is confirmed (a transaction lands in the slot after the
// one it was sent in, so the first asks may answer null). Bounded by
// TIMEOUT_MS; gives the status it ended on.
async function untilConfirmed(statuses) {
  const deadline = Date.now() + TIMEOUT_MS;
  for (;;) {
    const answer = await statuses();
    if (answer.value[0]?.confirmationStatus === "confirmed") return answer;
    if (Date.now() > deadline) throw new Error(`not confirmed in ${TIMEOUT_MS} ms: ${JSON.stringify(plain(answer))}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

// BigInts (kit's numbers) as strings, Buffers as base64.
function plain(value) {
  return JSON.parse(
    JSON.stringify(value, (_, v) => {
      if (typeof v === "bigint") return v.toString();
      if (v && v.type === "Buffer" && Array.isArray(v.data)) return Buffer.from(v.data).toString("base64");
      return v;
    }),
  );
}

async function withKit() {
  const rpc = kit.createSolanaRpc(httpUrl);
  const subscriptions = kit.createSolanaRpcSubscriptions(wsUrl);
  const confirmed = { commitment: "confirmed" };
  const out = {};
  out.slot = await rpc.getSlot(confirmed).send();
  out.blockHeight = await rpc.getBlockHeight(confirmed).send();
  out.epochInfo = await rpc.getEpochInfo().send();
  out.version = await rpc.getVersion().send();
  const { value: latest } = await rpc.getLatestBlockhash(confirmed).send();
  out.latestBlockhash = latest;
  out.balance = await rpc.getBalance(kit.address(ACCOUNT)).send();
  out.accountInfo = await rpc.getAccountInfo(kit.address(ACCOUNT), { encoding: "base64" }).send();
  out.multipleAccounts = await rpc
    .getMultipleAccounts([kit.address(ACCOUNT), kit.address(PROGRAM)], { encoding: "base64" })
    .send();
  out.programAccounts = await rpc.getProgramAccounts(kit.address(PROGRAM), { encoding: "base64" }).send();
  out.signaturesForAddress = await rpc.getSignaturesForAddress(kit.address(ACCOUNT)).send();
  const finalized = await rpc.getSlot().send();
  out.block = await rpc
    .getBlock(finalized, { transactionDetails: "signatures", rewards: false, maxSupportedTransactionVersion: 0 })
    .send();

  // A transfer of 1 lamport to ourselves, signed with the fixed key.
  const signer = await kit.createKeyPairSignerFromPrivateKeyBytes(SEED);
  const data = new Uint8Array(12);
  new DataView(data.buffer).setUint32(0, 2, true);
  new DataView(data.buffer).setBigUint64(4, 1n, true);
  const message = kit.pipe(
    kit.createTransactionMessage({ version: 0 }),
    (m) => kit.setTransactionMessageFeePayerSigner(signer, m),
    (m) => kit.setTransactionMessageLifetimeUsingBlockhash(latest, m),
    (m) =>
      kit.appendTransactionMessageInstruction(
        {
          programAddress: kit.address("11111111111111111111111111111111"),
          accounts: [
            { address: signer.address, role: kit.AccountRole.WRITABLE_SIGNER, signer },
            { address: signer.address, role: kit.AccountRole.WRITABLE },
          ],
          data,
        },
        m,
      ),
  );
  const transaction = await kit.signTransactionMessageWithSigners(message);
  const wire = kit.getBase64EncodedWireTransaction(transaction);
  out.simulate = await rpc.simulateTransaction(wire, { encoding: "base64", ...confirmed }).send();
  const sent = await rpc.sendTransaction(wire, { encoding: "base64", preflightCommitment: "confirmed" }).send();
  out.sentSignatureIsTheTransactions = sent === kit.getSignatureFromTransaction(transaction);
  out.transaction = await rpc.getTransaction(sent, { maxSupportedTransactionVersion: 0 }).send();
  out.signatureStatuses = await untilConfirmed(() => rpc.getSignatureStatuses([sent]).send());

  // PubSub: the first notification of each kind.
  const abort = new AbortController();
  const first = async (notifications, what) => {
    const iterator = (await notifications.subscribe({ abortSignal: abort.signal }))[Symbol.asyncIterator]();
    return (await within(iterator.next(), what)).value;
  };
  const [slot, account, signature] = await Promise.all([
    first(subscriptions.slotNotifications(), "slotNotifications"),
    first(subscriptions.accountNotifications(kit.address(ACCOUNT), { encoding: "base64", ...confirmed }), "accountNotifications"),
    first(subscriptions.signatureNotifications(sent, confirmed), "signatureNotifications"),
  ]);
  abort.abort();
  out.pubsub = { slot, account, signature };
  return out;
}

async function withWeb3js() {
  const connection = new web3.Connection(httpUrl, { commitment: "confirmed", wsEndpoint: wsUrl });
  const account = new web3.PublicKey(ACCOUNT);
  const program = new web3.PublicKey(PROGRAM);
  const out = {};
  out.slot = await connection.getSlot();
  out.blockHeight = await connection.getBlockHeight();
  out.epochInfo = await connection.getEpochInfo();
  out.version = await connection.getVersion();
  const latest = await connection.getLatestBlockhash();
  out.latestBlockhash = latest;
  out.balance = await connection.getBalance(account);
  out.accountInfo = await connection.getAccountInfo(account);
  out.multipleAccounts = await connection.getMultipleAccountsInfo([account, program]);
  out.programAccounts = (await connection.getProgramAccounts(program)).map((a) => ({
    pubkey: a.pubkey.toBase58(),
    account: { ...a.account, owner: a.account.owner.toBase58() },
  }));
  out.signaturesForAddress = await connection.getSignaturesForAddress(account);
  const finalized = await connection.getSlot("finalized");
  // web3.js 1.x has no "signatures" mode.
  out.block = await connection.getBlock(finalized, {
    transactionDetails: "none",
    rewards: false,
    maxSupportedTransactionVersion: 0,
  });

  const payer = web3.Keypair.fromSeed(SEED);
  const transaction = new web3.Transaction({ feePayer: payer.publicKey, ...latest }).add(
    web3.SystemProgram.transfer({ fromPubkey: payer.publicKey, toPubkey: payer.publicKey, lamports: 1 }),
  );
  transaction.sign(payer);
  const simulated = await connection.simulateTransaction(transaction);
  out.simulate = simulated;
  const sent = await connection.sendRawTransaction(transaction.serialize(), { preflightCommitment: "confirmed" });
  out.sentSignatureIsTheTransactions = sent === kit.getBase58Decoder().decode(transaction.signature);
  out.transaction = await connection.getTransaction(sent, { maxSupportedTransactionVersion: 0 });
  out.signatureStatuses = await untilConfirmed(() => connection.getSignatureStatuses([sent]));

  const once = (subscribe) =>
    new Promise((resolve) => {
      let id;
      id = subscribe((value, context) => {
        resolve({ value, context });
        return id;
      });
    });
  const [slot, accountChange, signature] = await within(
    Promise.all([
      once((cb) => connection.onSlotChange((info) => cb(info))),
      once((cb) => connection.onAccountChange(account, (info, context) => cb(info, context), { commitment: "confirmed" })),
      once((cb) => connection.onSignature(sent, (result, context) => cb(result, context), "confirmed")),
    ]),
    "subscriptions",
  );
  out.pubsub = { slot: slot.value, account: accountChange, signature };
  // Let the library close its socket, then stop.
  setTimeout(() => process.exit(0), 100);
  return out;
}

// Overload (`node solana.mjs kit|web3js overload HTTP_URL`): one getBalance
// against an endpoint that refuses it, with the library's default retries:
// what the caller is finally given (its error's words, and the HTTP status
// and retry-after where the library keeps them), and after how long.
async function overload(url) {
  const started = Date.now();
  // kit keeps the response's status and headers on its error (not the
  // body); web3.js 1.x puts the status and the body in its message.
  const headers = (error) => error?.context?.headers;
  const header = (error, name) => headers(error)?.get?.(name) ?? headers(error)?.[name] ?? null;
  const outcome = (error) => ({
    error: String(error?.message ?? error),
    status: error?.context?.statusCode ?? null,
    retryAfter: header(error, "retry-after"),
    rule: header(error, "x-stakegate-rule"),
    ms: Date.now() - started,
  });
  try {
    const value =
      library === "kit"
        ? await kit.createSolanaRpc(url).getBalance(kit.address(ACCOUNT)).send()
        : await new web3.Connection(url, { commitment: "confirmed" }).getBalance(new web3.PublicKey(ACCOUNT));
    return { answer: plain(value), ms: Date.now() - started };
  } catch (error) {
    return outcome(error);
  }
}

// Many subscriptions at once (`node solana.mjs kit|web3js many HTTP_URL
// WS_URL N`), as a wallet or an indexer opens them on start: N account
// subscriptions (N distinct accounts) and a slot subscription, all asked
// for together (Promise.all) on the library's one socket; each waits for
// its first notification, then all are closed. Prints how many got one,
// and the distinct slots the account notifications named.
async function many(http, ws, count) {
  const accounts = Array.from({ length: count }, (_, i) => {
    const seed = new Uint8Array(32).fill(0);
    new DataView(seed.buffer).setUint32(0, i + 1, true);
    return seed;
  });
  let notified;
  if (library === "kit") {
    const subscriptions = kit.createSolanaRpcSubscriptions(ws);
    const abort = new AbortController();
    const first = async (notifications, what) => {
      const iterator = (await notifications.subscribe({ abortSignal: abort.signal }))[Symbol.asyncIterator]();
      return (await within(iterator.next(), what)).value;
    };
    const keys = await Promise.all(accounts.map((seed) => kit.createKeyPairSignerFromPrivateKeyBytes(seed)));
    notified = await Promise.all([
      first(subscriptions.slotNotifications(), "slotNotifications").then((n) => ({ slot: Number(n.slot) })),
      ...keys.map((k, i) =>
        first(subscriptions.accountNotifications(k.address, { commitment: "confirmed" }), `account ${i}`).then((n) => ({
          account: Number(n.context.slot),
        })),
      ),
    ]);
    abort.abort();
  } else {
    const connection = new web3.Connection(http, { commitment: "confirmed", wsEndpoint: ws });
    const ids = [];
    const once = (subscribe, what) =>
      within(
        new Promise((resolve) => {
          ids.push(subscribe(resolve));
        }),
        what,
      );
    notified = await Promise.all([
      once((cb) => connection.onSlotChange((info) => cb({ slot: info.slot })), "slot"),
      ...accounts.map((seed, i) =>
        once(
          (cb) =>
            connection.onAccountChange(web3.Keypair.fromSeed(seed).publicKey, (_, context) => cb({ account: context.slot })),
          `account ${i}`,
        ),
      ),
    ]);
    await Promise.all(ids.map((id, i) => (i === 0 ? connection.removeSlotChangeListener(id) : connection.removeAccountChangeListener(id))));
  }
  return {
    subscriptions: notified.length,
    slotNotified: notified.filter((n) => "slot" in n).length,
    accountsNotified: notified.filter((n) => "account" in n).length,
    accountSlots: new Set(notified.filter((n) => "account" in n).map((n) => n.account)).size,
  };
}

const mode = process.argv[3];
const run =
  mode === "overload"
    ? () => overload(process.argv[4])
    : mode === "many"
      ? () => many(process.argv[4], process.argv[5], Number(process.argv[6]))
      : { kit: withKit, web3js: withWeb3js }[library];
if (!run || !["kit", "web3js"].includes(library)) {
  console.error(`usage: node solana.mjs kit|web3js HTTP_URL WS_URL | overload HTTP_URL | many HTTP_URL WS_URL N`);
  process.exit(2);
}
run()
  .then((out) => {
    console.log(JSON.stringify(plain(out)));
    process.exit(0);
  })
  .catch((e) => {
    console.error(`${library}: ${e?.stack ?? e}`);
    process.exit(1);
  });
