// The everyday operations of a dapp, done with a real client library
// against one JSON-RPC endpoint, printed as one JSON document so that a run
// through the gateway can be compared with a run straight at the node.
//
//   node ops.mjs viem|ethers HTTP_URL WS_URL
//   node ops.mjs viem|ethers overload HTTP_URL single|batch|duplicate|slow   (see `overload`)
//   node ops.mjs viem subscribe WS_URL N   (see `subscribeMany`)
//   node ops.mjs viem|ethers burst WS_URL N   (see `burst`)
//   node ops.mjs viem|ethers final HTTP_URL   (see `finalReads`)
//   node ops.mjs viem|ethers head HTTP_URL    (see `headReads`)
//   node ops.mjs ethers limited HTTP_URL N   (see `limited`)
//
// The chain must be anvil's dev chain (its unlocked accounts send the
// transaction). Exits non-zero, with the library's own error, if any
// operation fails.

import * as viem from "viem";
import { anvil } from "viem/chains";
import { FetchRequest, JsonRpcProvider, WebSocketProvider } from "ethers";

const [library, httpUrl, wsUrl] = process.argv.slice(2);
// anvil's dev accounts 0 (sender), 1 (receiver) and 9 (never touched).
const SENDER = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
const RECEIVER = "0x70997970c51812dc3a010c7d01b50e20d4dc79c8";
const IDLE = "0xa0ee7a142d267c1f36714e4a8f75612f20a79720";
// The identity precompile answers a call with its input.
const IDENTITY = "0x0000000000000000000000000000000000000004";
const TIMEOUT_MS = 60_000;

function within(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${TIMEOUT_MS} ms`)), TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// Mines a block, then another every 100 ms, until `head` (a newHeads
// subscription's first block) arrives: a subscription may not be in place
// at the node yet when the library says it is. Bounded by TIMEOUT_MS.
async function headAfterMining(head, mine) {
  let arrived = false;
  head.then(() => (arrived = true));
  const deadline = Date.now() + TIMEOUT_MS;
  while (!arrived && Date.now() < deadline) {
    await mine();
    await Promise.race([head, new Promise((r) => setTimeout(r, 100))]);
  }
  return within(head, "newHeads");
}

async function withViem() {
  const client = viem.createPublicClient({ chain: anvil, transport: viem.http(httpUrl, { retryCount: 0 }) });
  const batching = viem.createPublicClient({ chain: anvil, transport: viem.http(httpUrl, { batch: true, retryCount: 0 }) });
  const wallet = viem.createWalletClient({ chain: anvil, transport: viem.http(httpUrl, { retryCount: 0 }) });
  const out = {};
  out.chainId = await client.getChainId();
  out.blockNumber = Number(await client.getBlockNumber());
  out.balance = (await client.getBalance({ address: IDLE })).toString();
  out.call = (await client.call({ to: IDENTITY, data: "0x1234" })).data;
  const hash = await wallet.sendTransaction({ account: SENDER, to: RECEIVER, value: 1n });
  const receipt = await client.waitForTransactionReceipt({ hash, pollingInterval: 50 });
  out.transaction = { status: receipt.status, blockNumber: Number(receipt.blockNumber) };
  out.logs = (await client.getLogs({ fromBlock: 0n, toBlock: "latest" })).length;
  const [chainId, blockNumber] = await Promise.all([batching.getChainId(), batching.getBlockNumber()]);
  out.batch = [chainId, Number(blockNumber)];

  const ws = viem.createPublicClient({ chain: anvil, transport: viem.webSocket(wsUrl, { retryCount: 0 }) });
  out.ws = {
    chainId: await ws.getChainId(),
    blockNumber: Number(await ws.getBlockNumber()),
    call: (await ws.call({ to: IDENTITY, data: "0x1234" })).data,
  };
  let resolveHead;
  const head = new Promise((resolve) => (resolveHead = resolve));
  const { unsubscribe } = await ws.transport.subscribe({
    params: ["newHeads"],
    onData: (data) => resolveHead(Number(data.result.number)),
    onError: (e) => console.error(`viem newHeads: ${e}`),
  });
  out.ws.newHead = (await headAfterMining(head, () => client.request({ method: "evm_mine", params: [] }))) > out.ws.blockNumber;
  await unsubscribe();
  await ws.transport.getRpcClient().then((rpc) => rpc.close());
  return out;
}

async function withEthers() {
  const options = { staticNetwork: true, batchMaxCount: 1 };
  const provider = new JsonRpcProvider(httpUrl, undefined, options);
  const batching = new JsonRpcProvider(httpUrl, undefined, { staticNetwork: true, batchMaxCount: 10, batchStallTime: 20 });
  const out = {};
  out.chainId = Number((await provider.getNetwork()).chainId);
  out.blockNumber = await provider.getBlockNumber();
  out.balance = (await provider.getBalance(IDLE)).toString();
  out.call = await provider.call({ to: IDENTITY, data: "0x1234" });
  const signer = await provider.getSigner(SENDER);
  const sent = await signer.sendTransaction({ to: RECEIVER, value: 1n });
  const receipt = await sent.wait();
  out.transaction = {
    status: receipt.status === 1 ? "success" : "reverted",
    blockNumber: receipt.blockNumber,
  };
  out.logs = (await provider.getLogs({ fromBlock: 0, toBlock: "latest" })).length;
  const [chainId, blockNumber] = await Promise.all([batching.send("eth_chainId", []), batching.getBlockNumber()]);
  out.batch = [Number(chainId), blockNumber];

  const ws = new WebSocketProvider(wsUrl);
  out.ws = {
    chainId: Number((await ws.getNetwork()).chainId),
    blockNumber: await ws.getBlockNumber(),
    call: await ws.call({ to: IDENTITY, data: "0x1234" }),
  };
  const head = new Promise((resolve) => ws.once("block", (n) => resolve(n)));
  out.ws.newHead = (await headAfterMining(head, () => provider.send("evm_mine", []))) > out.ws.blockNumber;
  await ws.destroy();
  provider.destroy();
  batching.destroy();
  return out;
}

// Overload (`node ops.mjs viem|ethers overload HTTP_URL single|batch|duplicate|slow`):
// one call or one batch of two against an endpoint that refuses it, or
// `eth_getLogs [{}]` while the test keeps the same call in flight (dedup
// holds it for that call's answer), with the library's default retries:
// what the caller is finally given, and when. `slow`: an eth_call with a
// 1 s timeout to a node that takes longer, retried on each timeout: by viem
// itself (three retries, 150 ms doubling), and for ethers, which does not
// retry a timeout, by the program, five times at once, as an app would.
async function overload(url, what) {
  const batch = what === "batch";
  const slow = (send) => send("eth_call", [{ to: IDENTITY, data: library === "viem" ? "0x02" : "0x03" }, "latest"]);
  let call;
  let close = () => {};
  if (library === "viem") {
    const transport = viem.http(url, what === "slow" ? { timeout: 1000 } : { batch });
    const client = viem.createPublicClient({ chain: anvil, transport });
    call = {
      single: () => client.getBlockNumber(),
      batch: () => Promise.all([client.getChainId(), client.getBlockNumber()]),
      duplicate: () => client.request({ method: "eth_getLogs", params: [{}] }),
      slow: () => slow((method, params) => client.request({ method, params })),
    }[what];
  } else {
    // The chain is given, so that ethers does not also detect it (a refused
    // eth_chainId makes it log and retry every second, forever).
    const request = new FetchRequest(url);
    if (what === "slow") request.timeout = 1000;
    const provider = new JsonRpcProvider(request, anvil.id, { staticNetwork: true, batchMaxCount: batch ? 10 : 1, batchStallTime: 20 });
    const retried = async (method, params) => {
      for (let attempt = 1; ; attempt++) {
        try {
          return await provider.send(method, params);
        } catch (e) {
          if (e?.code !== "TIMEOUT" || attempt === 5) throw e;
        }
      }
    };
    call = {
      single: () => provider.getBlockNumber(),
      batch: () => Promise.all([provider.send("eth_chainId", []), provider.getBlockNumber()]),
      duplicate: () => provider.send("eth_getLogs", [{}]),
      slow: () => slow(retried),
    }[what];
    close = () => provider.destroy();
  }
  const started = Date.now();
  try {
    return { error: null, result: String(await call()), ms: Date.now() - started };
  } catch (e) {
    // viem's HttpRequestError names the status only in its details.
    const status = e?.status ? ` (status ${e.status})` : "";
    const error = `${e?.name ?? "Error"}: ${e?.shortMessage ?? e?.message ?? e}`.split("\n")[0].slice(0, 300) + status;
    return { error, ms: Date.now() - started };
  } finally {
    close();
  }
}

// Over its share (`node ops.mjs ethers limited HTTP_URL N`): N balance reads
// at once (`Promise.all`), one request each, from a client the gateway's QoS
// refuses some of with a 429, with ethers' default retries (it reads
// `retry-after` as milliseconds). For each call: the requests ethers sent,
// the refusals it was given (when, status, retry-after, rule), and when its
// caller got the answer or the error. Times are ms from the start.
async function limited(url, n) {
  const started = Date.now();
  const addresses = Array.from({ length: n }, (_, i) => `0x${(0xa11ce0000 + i).toString(16).padStart(40, "0")}`);
  const calls = new Map(addresses.map((a) => [a, { sent: 0, refused: [] }]));
  // ethers' hooks see each request it sends and each 429: the call is the
  // address read (ethers sends it checksummed).
  const of = (body) => calls.get(JSON.parse(new TextDecoder().decode(body)).params[0].toLowerCase());
  const request = new FetchRequest(url);
  request.preflightFunc = async (req) => {
    of(req.body).sent += 1;
    return req;
  };
  request.retryFunc = async (req, response) => {
    const headers = response.headers;
    const refusal = { ms: Date.now() - started, status: response.statusCode, retryAfter: Number(headers["retry-after"]) };
    of(req.body).refused.push({ ...refusal, rule: headers["x-stakegate-rule"] });
    return true;
  };
  const provider = new JsonRpcProvider(request, anvil.id, { staticNetwork: true, batchMaxCount: 1 });
  await Promise.all(
    addresses.map(async (address) => {
      const call = calls.get(address);
      try {
        await provider.getBalance(address);
      } catch (e) {
        call.error = `${e?.name ?? "Error"}: ${e?.shortMessage ?? e?.message ?? e}`.split("\n")[0].slice(0, 200);
      }
      call.answeredMs = Date.now() - started;
    }),
  );
  provider.destroy();
  return addresses.map((a) => calls.get(a));
}

// Burst (`node ops.mjs viem|ethers burst WS_URL N`): N balance reads at
// once on one WebSocket (`Promise.all`), as a dapp's page load makes them:
// how many were answered, the first error, and the balances, in order.
async function burst(url, n) {
  const addresses = Array.from({ length: n }, (_, i) => `0x${(i + 1).toString(16).padStart(40, "0")}`);
  let read;
  let close;
  if (library === "viem") {
    const client = viem.createPublicClient({ chain: anvil, transport: viem.webSocket(url, { retryCount: 0 }) });
    read = (address) => client.getBalance({ address });
    close = () => client.transport.getRpcClient().then((rpc) => rpc.close());
  } else {
    const provider = new WebSocketProvider(url, anvil.id, { staticNetwork: true });
    read = (address) => provider.getBalance(address);
    close = () => provider.destroy();
  }
  const started = Date.now();
  const settled = await Promise.allSettled(addresses.map(read));
  const ms = Date.now() - started;
  await close();
  const failed = settled.filter((s) => s.status === "rejected");
  return {
    answered: settled.length - failed.length,
    error: failed.length ? String(failed[0].reason?.shortMessage ?? failed[0].reason).split("\n")[0] : null,
    balances: settled.map((s) => (s.status === "fulfilled" ? s.value.toString() : null)),
    ms,
  };
}

// Subscriptions at once (`node ops.mjs viem subscribe WS_URL N`): N
// `newHeads` subscriptions asked for together (`Promise.all`) on viem's one
// socket, as an app watching several things opens them on start; then one
// block mined, each waiting for its notification; then all closed. Prints
// how many were opened and how many were notified.
async function subscribeMany(url, n) {
  const client = viem.createPublicClient({ chain: anvil, transport: viem.webSocket(url, { retryCount: 0 }) });
  const notified = [];
  const opened = await Promise.all(
    Array.from({ length: n }, () => {
      let resolve;
      notified.push(new Promise((r) => (resolve = r)));
      return client.transport.subscribe({ params: ["newHeads"], onData: () => resolve(true), onError: () => resolve(false) });
    }),
  );
  await client.request({ method: "evm_mine", params: [] });
  const heads = await Promise.all(notified);
  await Promise.all(opened.map((s) => s.unsubscribe()));
  await client.transport.getRpcClient().then((rpc) => rpc.close());
  return { opened: opened.length, notified: heads.filter(Boolean).length };
}

// Asks each question in turn, six rounds over: the answers, by round.
async function askRounds(ask, close) {
  const rounds = [];
  for (let round = 0; round < 6; round++) {
    const answers = [];
    for (const question of ask) answers.push(await question());
    rounds.push(answers);
  }
  close();
  return { rounds };
}

// Final reads (`node ops.mjs viem|ethers final HTTP_URL`): what a block
// explorer or an indexer asks about a final block (the block, a balance and
// a call at it, the logs up to it, the chain id), one after another, six
// times over: the answers, in order. (One at a time: the example policy's
// gate has 6 public slots, and a worker's spare slots stay its own for up
// to a heartbeat, so five at once may be shed.) The chain must have a
// finalized block (anvil finalises 64 blocks deep).
async function finalReads(url) {
  let ask;
  let close = () => {};
  if (library === "viem") {
    const client = viem.createPublicClient({ chain: anvil, transport: viem.http(url, { retryCount: 0 }) });
    const at = (await client.getBlock({ blockTag: "finalized" })).number;
    ask = [
      () => client.getBlock({ blockNumber: at }).then((b) => b.hash),
      () => client.getBalance({ address: SENDER, blockNumber: at }).then(String),
      () => client.call({ to: IDENTITY, data: "0x1234", blockNumber: at }).then((r) => r.data),
      () => client.getLogs({ fromBlock: 0n, toBlock: at }).then((logs) => logs.length),
      () => client.getChainId(),
    ];
  } else {
    const provider = new JsonRpcProvider(url, anvil.id, { staticNetwork: true, batchMaxCount: 1 });
    const at = (await provider.getBlock("finalized")).number;
    ask = [
      () => provider.getBlock(at).then((b) => b.hash),
      () => provider.getBalance(SENDER, at).then(String),
      () => provider.call({ to: IDENTITY, data: "0x1234", blockTag: at }),
      () => provider.getLogs({ fromBlock: 0, toBlock: at }).then((logs) => logs.length),
      () => provider.send("eth_chainId", []).then(Number),
    ];
    close = () => provider.destroy();
  }
  return askRounds(ask, close);
}

// Head reads (`node ops.mjs viem|ethers head HTTP_URL`): what a wallet asks
// at the head (the block number, the head block's hash, a balance, a nonce
// and a call at `latest`), one after another, six times over: the answers,
// in order, as ops.py's `head` prints them.
async function headReads(url) {
  let ask;
  let close = () => {};
  if (library === "viem") {
    const client = viem.createPublicClient({ chain: anvil, transport: viem.http(url, { retryCount: 0 }), cacheTime: 0 });
    ask = [
      () => client.getBlockNumber({ cacheTime: 0 }).then(Number),
      () => client.getBlock().then((b) => b.hash),
      () => client.getBalance({ address: SENDER }).then(String),
      () => client.getTransactionCount({ address: SENDER }),
      () => client.call({ to: IDENTITY, data: "0x1234" }).then((r) => r.data),
    ];
  } else {
    const provider = new JsonRpcProvider(url, anvil.id, { staticNetwork: true, batchMaxCount: 1 });
    ask = [
      () => provider.getBlockNumber(),
      () => provider.getBlock("latest").then((b) => b.hash),
      () => provider.getBalance(SENDER).then(String),
      () => provider.getTransactionCount(SENDER),
      () => provider.call({ to: IDENTITY, data: "0x1234" }),
    ];
    close = () => provider.destroy();
  }
  return askRounds(ask, close);
}

const run =
  httpUrl === "final"
    ? () => finalReads(wsUrl)
    : httpUrl === "head"
    ? () => headReads(wsUrl)
    : httpUrl === "overload"
    ? () => overload(wsUrl, process.argv[5])
    : httpUrl === "limited" && library === "ethers"
    ? () => limited(wsUrl, Number(process.argv[5]))
    : httpUrl === "burst"
      ? () => burst(wsUrl, Number(process.argv[5]))
      : httpUrl === "subscribe" && library === "viem"
        ? () => subscribeMany(wsUrl, Number(process.argv[5]))
        : { viem: withViem, ethers: withEthers }[library];
if (!["viem", "ethers"].includes(library) || !run) {
  console.error(`usage: node ops.mjs viem|ethers HTTP_URL WS_URL, or node ops.mjs viem|ethers overload HTTP_URL single|batch|duplicate|slow, or node ops.mjs viem|ethers burst WS_URL N, or node ops.mjs viem|ethers final|head HTTP_URL, or node ops.mjs ethers limited HTTP_URL N, or node ops.mjs viem subscribe WS_URL N (not ${library})`);
  process.exit(2);
}
try {
  console.log(JSON.stringify(await within(run(), library)));
  process.exit(0);
} catch (e) {
  console.error(`${library}: ${e?.stack ?? e}`);
  process.exit(1);
}
