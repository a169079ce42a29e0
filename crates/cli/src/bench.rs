//! `stakegate bench`: what the filters cost a real Envoy.
//!
//! `filters`: every filter chain side by side, from one run. One Envoy
//! (`--concurrency 1`, pinned to the last core when there are two) has a
//! listener per chain, routing to an upstream listener of the same Envoy
//! that answers at once (the hop a gateway makes to its node, and where
//! dedup's callouts go), behind the buffer filter, as the gateway configs
//! put it first, then the chain: no filter, Envoy's own `local_ratelimit`,
//! a no-op proxy-wasm filter, or stakegate's filters and their chain. wrk (on the first core) POSTs
//! JSON-RPC calls whose params differ per request, as real traffic does,
//! over kept-alive connections, to each listener in turn, round after
//! round, starting each round one chain further on, so every chain sees the
//! same process and the same machine noise. A chain's result is the median
//! and the interquartile range of its per-round ratio to no filter, and
//! the median time it adds to a request (Envoy's one worker is busy the
//! whole run, so a request costs `1 / rps` of it).
//!
//! `host-calls`: the same, for a probe filter (tests/fixtures/host-call-probe)
//! making one kind of the host calls the filters make: where their cost
//! beyond the no-op filter goes.
//!
//! `qos-refill`: how long a stake QoS refill round takes as the identity
//! table fills. `qos-scale`: what a request costs stake QoS at 10 to
//! 100,000 identities, and Envoy's memory. Both answer at once, with no
//! upstream hop, so that 100,000 addresses are all active at the rate one
//! core reaches.

use anyhow::{bail, Context};
use serde::Serialize;
use stakegate_stack::admin::Quantile;
use stakegate_stack::envoy::Answer;
use stakegate_stack::{envoy, paths, Envoy, EnvoyBuilder, FilterConfig, FleetEngine};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct FiltersArgs {
    /// Rounds (each runs every chain once).
    #[arg(long, default_value_t = 30)]
    pub rounds: usize,
    /// Length of one wrk run.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// wrk connections.
    #[arg(long, default_value_t = 32)]
    pub connections: u32,
    /// Where summary.json and the chart go.
    #[arg(long, default_value = "results/bench")]
    pub out: PathBuf,
    /// envoyproxy/ratelimit's `service_cmd`: adds a chain with Envoy's
    /// rate-limit filter asking it (on the same Redis as fleet mode) about
    /// every request, the other way to a shared engine.
    #[arg(long)]
    pub ratelimit: Option<PathBuf>,
    /// Only the chains whose names contain one of these (repeatable), with
    /// no filter and the no-op Wasm filter the ratios need.
    #[arg(long = "only")]
    pub only: Vec<String>,
}

/// One filter of a chain.
#[derive(Clone)]
enum Element {
    /// Envoy's own filter, as its `http_filters` entry.
    Native(&'static str),
    /// A proxy-wasm module through file-based ECDS.
    Wasm(FilterConfig),
}

/// A chain under test, and what it is.
struct Chain {
    name: &'static str,
    what: &'static str,
    elements: Vec<Element>,
    /// Most answers are refusals (wrk counts them as non-2xx).
    refuses: bool,
    /// The wrk script of its calls (`UNIQUE_CALLS` but for the cache's).
    calls: &'static str,
}

/// Envoy's local rate limit with a bucket that never empties.
/// Envoy's rate-limit filter, asking envoyproxy/ratelimit (cluster
/// `ratelimit`) about every request, by remote address.
const RATELIMIT_SERVICE: &str = r#"          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: stakegate
              request_type: both
              failure_mode_deny: true
              # Its default, 20 ms, fails requests on a busy machine.
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: { envoy_grpc: { cluster_name: ratelimit } }"#;

/// The `ratelimit` cluster, at `{{RATELIMIT_PORT}}`.
const RATELIMIT_CLUSTER: &str = r#"  - name: ratelimit
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: ratelimit
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: { address: 127.0.0.1, port_value: {{RATELIMIT_PORT}} }"#;

const LOCAL_RATELIMIT: &str = r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: bench
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { runtime_key: bench_enabled, default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { runtime_key: bench_enforced, default_value: { numerator: 100, denominator: HUNDRED } }"#;

// Each deciding once the body is whole, as the example policies and
// gateway.yaml do (the bench listener holds the headers, as they do).
const GATE: &str = r#"{"maxInflight": 1000000, "decideOnBody": true}"#;
/// Room for every call of a 1 s window at the rates a core reaches. The
/// bench's upstream answers at once, so coalescing stands by.
const GATE_DEDUP: &str =
    r#"{"maxInflight": 1000000, "dedup": {"maxEntries": 65536}, "decideOnBody": true}"#;
/// The same, engaged whatever the node: every call checked, and each sent
/// by the gate's callout.
const GATE_DEDUP_ENGAGED: &str = r#"{"maxInflight": 1000000, "dedup": {"maxEntries": 65536, "engageAfterMs": 0}, "decideOnBody": true}"#;
/// The gate with dedup, and in node time: each answer timed and told to
/// QoS, cheap calls kept a slot.
const GATE_NODE_TIME: &str = r#"{"maxInflight": 1000000, "dedup": {"maxEntries": 65536}, "decideOnBody": true, "nodeTime": {}}"#;
/// The gate with dedup and the answer cache.
const GATE_CACHE: &str = r#"{"maxInflight": 1000000, "dedup": {"maxEntries": 65536}, "decideOnBody": true, "cache": {}}"#;
const QOS_BELOW: &str = r#"{"capacityRps": 10000000, "decideOnBody": true}"#;
/// Below its threshold, identifying every request (as it does from
/// `identifyAbove` of capacity on, a tenth of it for calls like these).
const QOS_IDENTIFYING: &str =
    r#"{"capacityRps": 10000000, "decideOnBody": true, "identifyAbove": 0}"#;
/// Below its threshold, in fleet mode: exchanging with Redis through
/// Webdis every 100 ms.
const QOS_FLEET: &str =
    r#"{"capacityRps": 10000000, "decideOnBody": true, "fleet": {"syncMs": 100}}"#;
const QOS_THROTTLING: &str = r#"{"capacityRps": 100, "decideOnBody": true}"#;
/// The same policies as shadow candidates: deciding alike, refusing none.
const QOS_IDENTIFYING_SHADOW: &str =
    r#"{"capacityRps": 10000000, "decideOnBody": true, "identifyAbove": 0, "shadow": true}"#;
const QOS_THROTTLING_SHADOW: &str = r#"{"capacityRps": 100, "decideOnBody": true, "shadow": true}"#;
/// Below its threshold, sharing the node's time: every request identified,
/// its body's methods charged, its answer timed.
const QOS_NODE_TIME: &str = r#"{"capacityNodeMs": 100000000, "decideOnBody": true}"#;

fn chains(args: &FiltersArgs) -> anyhow::Result<Vec<Chain>> {
    let gate = |policy: &str| -> anyhow::Result<Element> {
        Ok(Element::Wasm(FilterConfig::admission_gate(
            paths::wasm_module("admission_gate")?,
            policy,
        )))
    };
    let qos = |policy: &str| -> anyhow::Result<Element> {
        Ok(Element::Wasm(FilterConfig::stake_qos(
            paths::wasm_module("stake_qos")?,
            policy,
        )))
    };
    let noop = || -> anyhow::Result<Element> {
        Ok(Element::Wasm(FilterConfig::other(
            "noop",
            paths::wasm_module("noop_filter")?,
            "",
        )))
    };
    let chain = |name, what, elements, refuses| Chain {
        name,
        what,
        elements,
        refuses,
        calls: UNIQUE_CALLS,
    };
    Ok([
        chain(NO_FILTER, "Envoy answering by itself", vec![], false),
        chain(
            "local_ratelimit",
            "Envoy's own rate limit, a bucket that never empties",
            vec![Element::Native(LOCAL_RATELIMIT)],
            false,
        ),
        chain(
            NOOP,
            "a proxy-wasm filter that does nothing",
            vec![noop()?],
            false,
        ),
        chain(
            "two no-op Wasm",
            "two such filters: what a second Wasm filter adds by itself",
            vec![noop()?, noop()?],
            false,
        ),
        chain(
            "gate",
            "the admission gate, under its limit",
            vec![gate(GATE)?],
            false,
        ),
        chain(
            "gate + dedup",
            "the gate with retry-storm protection, standing by (the node answers at once)",
            vec![gate(GATE_DEDUP)?],
            false,
        ),
        chain(
            "gate + dedup engaged",
            "the same, engaged: every call checked and sent by callout, every call new",
            vec![gate(GATE_DEDUP_ENGAGED)?],
            false,
        ),
        chain(
            "QoS below",
            "stake QoS far below its threshold: counting, not identifying",
            vec![qos(QOS_BELOW)?],
            false,
        ),
        chain(
            "QoS identifying",
            "stake QoS below its threshold, identifying every request",
            vec![qos(QOS_IDENTIFYING)?],
            false,
        ),
        chain(
            "QoS below, fleet",
            "stake QoS below its threshold, in fleet mode (Redis through Webdis)",
            vec![qos(QOS_FLEET)?],
            false,
        ),
        chain(
            "QoS throttling",
            "stake QoS over its threshold: mostly 429s",
            vec![qos(QOS_THROTTLING)?],
            true,
        ),
        chain(
            "QoS identifying, shadow",
            "the same policy as QoS identifying, as a shadow candidate (stakegate deploy --shadow)",
            vec![qos(QOS_IDENTIFYING_SHADOW)?],
            false,
        ),
        chain(
            "QoS throttling, shadow",
            "QoS throttling's policy as a shadow: it would refuse most requests, and refuses none",
            vec![qos(QOS_THROTTLING_SHADOW)?],
            false,
        ),
        chain(
            "gate + dedup, node time",
            "the gate with dedup in nodeTime, far below its limits: requests on spare slots neither priced nor timed",
            vec![gate(GATE_NODE_TIME)?],
            false,
        ),
        chain(
            "QoS node time",
            "stake QoS sharing node time, below its threshold",
            vec![qos(QOS_NODE_TIME)?],
            false,
        ),
        chain(
            "full chain",
            "stake QoS, then the gate with dedup, as a gateway with a quick node runs",
            vec![qos(QOS_BELOW)?, gate(GATE_DEDUP)?],
            false,
        ),
        chain(
            "full chain, node time",
            "stake QoS sharing node time (capacityNodeMs), then the gate with dedup in nodeTime, with a quick node",
            vec![qos(QOS_NODE_TIME)?, gate(GATE_NODE_TIME)?],
            false,
        ),
        chain(
            "full chain, engaged",
            "stake QoS identifying, then the gate with dedup engaged",
            vec![qos(QOS_IDENTIFYING)?, gate(GATE_DEDUP_ENGAGED)?],
            false,
        ),
        Chain {
            calls: SAME_FINAL_CALL,
            ..chain(
                "gate + cache, hit",
                "the gate with the answer cache, every call one it has kept (eth_chainId, each with its own id)",
                vec![gate(GATE_CACHE)?],
                false,
            )
        },
        Chain {
            calls: UNIQUE_FINAL_CALLS,
            ..chain(
                "full chain + cache, miss",
                "the full chain with the cache, every call new and one it would keep (eth_call at a block number): the cache sees no key repeat and stands by",
                vec![qos(QOS_BELOW)?, gate(GATE_CACHE)?],
                false,
            )
        },
        Chain {
            calls: MOSTLY_UNIQUE_FINAL_CALLS,
            ..chain(
                "full chain + cache, engaged miss",
                "the same with one call in 32 repeated (a hit): the cache engaged, every call looked up, 31 in 32 a new key's miss",
                vec![qos(QOS_BELOW)?, gate(GATE_CACHE)?],
                false,
            )
        },
    ]
    .into_iter()
    .chain(args.ratelimit.is_some().then(|| {
        chain(
            RATELIMIT,
            "Envoy's rate-limit filter asking envoyproxy/ratelimit (Redis) about each request",
            vec![Element::Native(RATELIMIT_SERVICE)],
            false,
        )
    }))
    .collect())
}

const NO_FILTER: &str = "no filter";
const NOOP: &str = "no-op Wasm";
const RATELIMIT: &str = "envoyproxy/ratelimit";

/// One Envoy answering by itself, with a listener per `(name, elements)`.
/// Each Wasm filter gets its own names and VM, in every chain and place.
fn direct(listeners: &[(String, Vec<Element>)], answer: Answer) -> anyhow::Result<EnvoyBuilder> {
    let mut blocks = Vec::new();
    let mut configs = Vec::new();
    for (i, (name, elements)) in listeners.iter().enumerate() {
        let entries: Vec<String> = elements
            .iter()
            .enumerate()
            .map(|(j, element)| match element {
                Element::Native(entry) => entry.to_string(),
                Element::Wasm(config) => {
                    let config = config.named(&format!("c{i}f{j}"));
                    let entry = config.http_filter_entry();
                    configs.push(config);
                    entry
                }
            })
            .collect();
        blocks.push((name.as_str(), entries.join("\n")));
    }
    let refs: Vec<(&str, &str)> = blocks.iter().map(|(n, f)| (*n, f.as_str())).collect();
    Ok(configs
        .into_iter()
        .fold(envoy::direct_response(&refs, answer)?, EnvoyBuilder::filter))
}

/// One chain's results.
#[derive(Debug, Serialize)]
struct ChainResult {
    chain: &'static str,
    what: &'static str,
    rps: Vec<f64>,
    /// Per round, this chain's rps over no filter's.
    ratios: Vec<f64>,
    median_rps: f64,
    median_ratio: f64,
    /// The middle half of the per-round ratios.
    ratio_iqr: [f64; 2],
    /// Per round, this chain's rps over the no-op Wasm filter's.
    median_ratio_to_noop: f64,
    /// Median of what the chain adds to a request's cost, in µs of Envoy's
    /// one worker: `1/rps - 1/rps(no filter)` per round.
    added_us: f64,
    /// Median share of the run Envoy's threads were on a CPU (1.0: one core
    /// busy the whole time, so Envoy was the bottleneck).
    envoy_busy: f64,
}

#[derive(Debug, Serialize)]
struct FiltersSummary {
    machine: String,
    rounds: usize,
    duration_s: f64,
    connections: u32,
    pinned: bool,
    chains: Vec<ChainResult>,
}

/// The machine, as the summary describes it.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cores} cores ({cpu})")
}

pub fn filters(args: &FiltersArgs) -> anyhow::Result<()> {
    let mut chains = chains(args)?;
    if !args.only.is_empty() {
        chains.retain(|c| {
            [NO_FILTER, NOOP].contains(&c.name) || args.only.iter().any(|o| c.name.contains(o))
        });
    }
    run_chains(args, &chains, &args.out)
}

/// The host calls the filters make, one kind per chain (`FilterConfig` of
/// the host-call probe fixture), beside the no-op filter they add to.
fn host_call_chains() -> anyhow::Result<Vec<Chain>> {
    let probe = |calls: &str| -> anyhow::Result<Vec<Element>> {
        Ok(vec![Element::Wasm(FilterConfig::other(
            "host_call_probe",
            paths::wasm_module("host_call_probe")?,
            calls,
        ))])
    };
    let chain = |name, what, calls: &str| -> anyhow::Result<Chain> {
        Ok(Chain {
            name,
            what,
            elements: probe(calls)?,
            refuses: false,
            calls: UNIQUE_CALLS,
        })
    };
    Ok(vec![
        Chain {
            name: NO_FILTER,
            what: "Envoy answering by itself",
            elements: vec![],
            refuses: false,
            calls: UNIQUE_CALLS,
        },
        chain(NOOP, "a proxy-wasm filter that does nothing", "")?,
        chain("address", "the source.address property", "address")?,
        chain("connection id", "the connection.id property", "connection")?,
        chain("clock x3", "three reads of the host clock", "clock")?,
        chain("headers x2", "two request header reads", "headers")?,
        chain("body 64 B", "the body's first 64 bytes", "body")?,
        chain(
            "shared x2",
            "a shared-data read and CAS write, twice",
            "shared",
        )?,
        chain(
            "pages 6.5 KB",
            "a read of one of 800 shared values of a full QoS page's size, in turn",
            &format!("pages={QOS_PAGE_BYTES}"),
        )?,
        chain(
            "callout",
            "the request sent by callout and answered as a local reply",
            "callout",
        )?,
        chain(
            "QoS's calls",
            "what stake QoS calls below its threshold",
            "address,clock,headers,body",
        )?,
    ])
}

/// A full page of stake QoS's identity table, in bytes.
const QOS_PAGE_BYTES: usize = stakegate_core::shared::PageLayout::HEADER_LEN
    + stakegate_core::qos::page::ENTRIES_PER_PAGE * stakegate_core::qos::page::ENTRY_LEN;

/// `stakegate bench host-calls`: what each kind of host call adds to the
/// no-op filter, as `filters` measures chains (summary in `out/host-calls`).
pub fn host_calls(args: &FiltersArgs) -> anyhow::Result<()> {
    run_chains(args, &host_call_chains()?, &args.out.join("host-calls"))
}

fn run_chains(args: &FiltersArgs, chains: &[Chain], out: &Path) -> anyhow::Result<()> {
    require_wrk()?;
    let listeners: Vec<(String, Vec<Element>)> = (0..chains.len())
        .map(|i| (format!("chain-{i}"), chains[i].elements.clone()))
        .collect();
    // Fleet mode's engine, for the chains in fleet mode, and
    // envoyproxy/ratelimit on the same Redis when asked for.
    let mut engine = FleetEngine::start()?;
    let ratelimit = match &args.ratelimit {
        Some(binary) => Some(engine.ratelimit(binary, 1_000_000_000)?),
        None => None,
    };
    let mut builder = direct(&listeners, Answer::Upstream)?
        .fleet(&engine)
        .concurrency(1);
    if let Some((_, port)) = &ratelimit {
        builder = builder
            .var("EXTRA_CLUSTERS", RATELIMIT_CLUSTER)
            .var("RATELIMIT_PORT", port);
    }
    let envoy = builder.start()?;
    let pinned = pin(&[&envoy]);
    let scripts = chains
        .iter()
        .map(|chain| {
            let script = tempfile::Builder::new().suffix(".lua").tempfile()?;
            std::fs::write(script.path(), chain.calls)?;
            Ok(script)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    println!(
        "filters: one Envoy --concurrency 1, a listener per chain; wrk -c{} for {:?} per chain and round, {} rounds, on {}{}",
        args.connections,
        args.duration,
        args.rounds,
        machine(),
        if pinned { "; Envoy on the last core, wrk on the first" } else { "" }
    );
    let url = |i: usize| envoy.url(&listeners[i].0);
    for (i, chain) in chains.iter().enumerate() {
        check_in_path(&envoy, chain, || {
            wrk(
                &url(i)?,
                args.connections,
                Duration::from_secs(1),
                scripts[i].path(),
                chain.refuses,
            )
        })
        .with_context(|| format!("chain {:?}", chain.name))?;
    }
    let mut runs: Vec<Vec<Run>> = (0..chains.len()).map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        for k in 0..chains.len() {
            let i = (round + k) % chains.len();
            let busy = Busy::start(&envoy)?;
            let mut run = wrk(
                &url(i)?,
                args.connections,
                args.duration,
                scripts[i].path(),
                chains[i].refuses,
            )?;
            run.busy = busy.share()?;
            runs[i].push(run);
        }
        let line: Vec<String> = chains
            .iter()
            .zip(&runs)
            .map(|(c, r)| format!("{} {:.0}", c.name, r[round].rps))
            .collect();
        println!("round {}: {}", round + 1, line.join(", "));
    }
    let rps: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| r.iter().map(|x| x.rps).collect())
        .collect();
    let per_round = |i: usize, base: usize| -> Vec<f64> {
        rps[i].iter().zip(&rps[base]).map(|(a, b)| a / b).collect()
    };
    let noop = chains.iter().position(|c| c.name == NOOP).unwrap_or(0);
    let results: Vec<ChainResult> = chains
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let ratios = per_round(i, 0);
            let added: Vec<f64> = rps[i]
                .iter()
                .zip(&rps[0])
                .map(|(a, b)| 1e6 / a - 1e6 / b)
                .collect();
            ChainResult {
                chain: c.name,
                what: c.what,
                median_rps: median(&rps[i]),
                median_ratio: median(&ratios),
                ratio_iqr: [quantile(&ratios, 0.25), quantile(&ratios, 0.75)],
                median_ratio_to_noop: median(&per_round(i, noop)),
                added_us: median(&added),
                envoy_busy: median(&runs[i].iter().map(|r| r.busy).collect::<Vec<_>>()),
                ratios,
                rps: rps[i].clone(),
            }
        })
        .collect();
    println!("\n{}", table(&results));
    if chains.iter().any(|c| c.name == RATELIMIT) {
        // That row means something only if the service answered each call.
        let asked = envoy.stat("cluster.ratelimit.upstream_rq_total")?;
        let ok = envoy.stat("cluster.rpc_node.ratelimit.ok")?;
        println!("envoyproxy/ratelimit: asked {asked} times, {ok} answered OK");
        if ok == 0 {
            bail!("envoyproxy/ratelimit never answered: its row measures nothing");
        }
    }
    if chains.iter().any(|c| c.name.contains("fleet")) {
        // The fleet row means something only if its exchanges worked.
        let exchanges = envoy.stat("wasmcustom.stakegate.qos.fleet.exchanges")?;
        let failures = envoy.stat("wasmcustom.stakegate.qos.fleet.exchange_failures")?;
        println!("fleet mode: {exchanges} exchanges with Redis through Webdis, {failures} failed");
        if exchanges == 0 {
            bail!("the chain in fleet mode never exchanged with Redis: its row is not fleet mode");
        }
    }
    if chains.iter().any(|c| c.calls == SAME_FINAL_CALL) {
        // The hit row means something only if its calls were hits.
        let hits = envoy.stat("wasmcustom.stakegate.gate.cache.hits")?;
        println!("cache: {hits} hits");
        if hits == 0 {
            bail!("the cache's hit row had no hit: it measured something else");
        }
    }
    if chains.iter().any(|c| c.calls == UNIQUE_FINAL_CALLS) {
        // And the miss row only if the cache stood by.
        let stat = |name: &str| envoy.stat(&format!("wasmcustom.stakegate.gate.cache.{name}"));
        let (misses, passed) = (stat("misses")?, stat("standing_by")?);
        println!("cache: {misses} misses looked up, {passed} requests passed standing by");
        if passed == 0 {
            bail!("the cache never stood by: the miss row measured lookups");
        }
    }
    if let Some(idle) = results.iter().find(|r| r.envoy_busy < 0.9) {
        eprintln!(
            "warning: Envoy was busy only {:.0}% of the {} runs: the load, not Envoy, set their pace",
            idle.envoy_busy * 100.0,
            idle.chain
        );
    }
    let summary = FiltersSummary {
        machine: machine(),
        rounds: args.rounds,
        duration_s: args.duration.as_secs_f64(),
        connections: args.connections,
        pinned,
        chains: results,
    };
    crate::summary::write(out, &summary)?;
    let chart = out.join("filters.png");
    let bars: Vec<(String, f64, [f64; 2])> = summary
        .chains
        .iter()
        .map(|c| (c.chain.to_string(), c.median_ratio, c.ratio_iqr))
        .collect();
    crate::scenario::plot::bars(
        &bars,
        "throughput against Envoy with no filter (median, interquartile range)",
        &chart,
    )?;
    eprintln!("chart written to {}", chart.display());
    Ok(())
}

/// How long every filter may take to hand Envoy its counts (the gate's
/// heartbeat is a second by default).
const COUNTS_FLUSHED: Duration = Duration::from_secs(10);

/// Runs `send` through `chain` and checks that each of its stakegate
/// filters counted every request it sent: the filter was in the path. The
/// filters' stats are shared by every VM, so the other chains' counts must
/// be in before this one sends (each check waits for its own).
fn check_in_path(
    envoy: &Envoy,
    chain: &Chain,
    send: impl FnOnce() -> anyhow::Result<Run>,
) -> anyhow::Result<()> {
    let counted = |config: &FilterConfig| -> anyhow::Result<i64> {
        Ok(if config.name.starts_with("stakegate.admission_gate") {
            // A cache hit is answered before admission.
            envoy.stat("wasmcustom.stakegate.gate.admitted.default")?
                + envoy.stat("wasmcustom.stakegate.gate.cache.hits")?
        } else if config.name.starts_with("stakegate.stake_qos") {
            // A shadow candidate counts under a prefix of its own.
            let prefix = stakegate_core::qos::policy::QosPolicy::parse(config.policy.as_bytes())
                .map_err(|e| anyhow::anyhow!("{}: {e}", config.name))?
                .stats_prefix();
            let stat = |name: &str| envoy.stat(&format!("wasmcustom.{prefix}.{name}"));
            stat("admitted.unstaked")? + stat("throttled.unstaked")? + stat("counted")?
        } else {
            0
        })
    };
    let ours: Vec<&FilterConfig> = chain
        .elements
        .iter()
        .filter_map(|e| match e {
            Element::Wasm(c)
                if c.name.starts_with("stakegate.admission_gate")
                    || c.name.starts_with("stakegate.stake_qos") =>
            {
                Some(c)
            }
            _ => None,
        })
        .collect();
    let before: Vec<i64> = ours
        .iter()
        .map(|c| counted(c))
        .collect::<anyhow::Result<_>>()?;
    let sent = send()?.requests as i64;
    for (config, before) in ours.iter().zip(before) {
        let started = Instant::now();
        while counted(config)? - before < sent {
            if started.elapsed() > COUNTS_FLUSHED {
                bail!(
                    "{} counted {} of the {sent} requests sent through {}: it is not in the path",
                    config.name,
                    counted(config)? - before,
                    chain.name
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

fn table(results: &[ChainResult]) -> String {
    let w = results.iter().map(|r| r.chain.len()).max().unwrap_or(5);
    let mut out = format!(
        "{:<w$} {:>8} {:>13} {:>13} {:>14} {:>10}\n",
        "chain", "rps", "vs no filter", "IQR", "vs no-op Wasm", "added µs"
    );
    for r in results {
        out.push_str(&format!(
            "{:<w$} {:>8.0} {:>13.3} {:>13} {:>14.3} {:>10.1}\n",
            r.chain,
            r.median_rps,
            r.median_ratio,
            format!("{:.2}-{:.2}", r.ratio_iqr[0], r.ratio_iqr[1]),
            r.median_ratio_to_noop,
            r.added_us
        ));
    }
    out
}

/// A wrk script that POSTs an eth_call whose params differ per request.
const UNIQUE_CALLS: &str = r#"local n = 0
request = function()
  n = n + 1
  local body = string.format('{"jsonrpc":"2.0","id":%d,"method":"eth_call","params":[{"to":"0x%040d","data":"0x%d"},"latest"]}', n, n, n)
  return wrk.format("POST", "/", {["content-type"] = "application/json"}, body)
end
"#;

/// The same call every time, one the cache keeps (the chain's id), each
/// with its own id.
const SAME_FINAL_CALL: &str = r#"local n = 0
request = function()
  n = n + 1
  local body = string.format('{"jsonrpc":"2.0","id":%d,"method":"eth_chainId","params":[]}', n)
  return wrk.format("POST", "/", {["content-type"] = "application/json"}, body)
end
"#;

/// Like `UNIQUE_CALLS`, at a block number, but one call in `$every` (none
/// with 0) the same final call each time (a hit). Unique across wrk's
/// threads (each numbered in `setup`) and runs (the second it started): a
/// repeat would be kept at its second miss, then a hit.
macro_rules! final_calls {
    ($every:literal) => {
        concat!(
            "local every = ",
            $every,
            r#"
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread", threads)
end
local n = 0
local run = 0
init = function(args)
  run = os.time()
end
request = function()
  n = n + 1
  local body
  if every > 0 and n % every == 0 then
    body = string.format('{"jsonrpc":"2.0","id":%d,"method":"eth_chainId","params":[]}', n)
  else
    body = string.format('{"jsonrpc":"2.0","id":%d,"method":"eth_call","params":[{"to":"0x%040d","data":"0x%d%d%d"},"0x1"]}', n, n, run, thread, n)
  end
  return wrk.format("POST", "/", {["content-type"] = "application/json"}, body)
end
"#
        )
    };
}

/// Each call a new key's first miss in the cache (its answer neither read
/// whole nor kept): the cache stands by after its first window of lookups.
const UNIQUE_FINAL_CALLS: &str = final_calls!("0");

/// One call in 32 a repeat: enough to keep the cache engaged (at least
/// one lookup in `cache::REPEATS_AT_LEAST`), so every call is looked up.
const MOSTLY_UNIQUE_FINAL_CALLS: &str = final_calls!("32");

fn require_wrk() -> anyhow::Result<()> {
    if Command::new("wrk").arg("--version").output().is_err() {
        bail!("wrk is not installed: `apt-get install wrk` (or `make bench`, which does it)");
    }
    Ok(())
}

/// One wrk run.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    rps: f64,
    requests: u64,
    /// Set by the caller: Envoy's share of the run on a CPU.
    busy: f64,
}

/// One wrk run against `url` (on core 0 when pinning), with `script`
/// shaping the requests; `refusals` allows non-2xx answers.
fn wrk(
    url: &str,
    connections: u32,
    duration: Duration,
    script: &Path,
    refusals: bool,
) -> anyhow::Result<Run> {
    let output = Command::new("taskset")
        .args(["-c", "0", "wrk", "-t1"])
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .context("running wrk")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if text.contains("Socket errors") || (!refusals && text.contains("Non-2xx")) {
        bail!("wrk saw errors:\n{text}");
    }
    let rps = text
        .lines()
        .find_map(|line| line.strip_prefix("Requests/sec:"))
        .and_then(|rps| rps.trim().parse().ok())
        .with_context(|| format!("no Requests/sec in wrk's output:\n{text}"))?;
    let requests = text
        .lines()
        .find_map(|line| line.trim().split_once(" requests in "))
        .and_then(|(n, _)| n.trim().parse().ok())
        .with_context(|| format!("no request count in wrk's output:\n{text}"))?;
    Ok(Run {
        rps,
        requests,
        busy: 0.0,
    })
}

/// Envoy's CPU time over a stretch of wall time.
struct Busy {
    pid: u32,
    cpu_ns: u64,
    started: Instant,
}

impl Busy {
    fn start(envoy: &Envoy) -> anyhow::Result<Self> {
        Ok(Self {
            pid: envoy.pid(),
            cpu_ns: cpu_ns(envoy.pid())?,
            started: Instant::now(),
        })
    }

    /// CPU time over wall time since `start`.
    fn share(&self) -> anyhow::Result<f64> {
        let cpu = cpu_ns(self.pid)?.saturating_sub(self.cpu_ns) as f64 / 1e9;
        Ok(cpu / self.started.elapsed().as_secs_f64())
    }
}

/// Time on a CPU of every thread of `pid`, from /proc (schedstat).
fn cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let tasks = format!("/proc/{pid}/task");
    let mut total = 0;
    for task in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let path = task?.path().join("schedstat");
        // A thread that ended since the listing has nothing to add.
        if let Ok(text) = std::fs::read_to_string(&path) {
            total += text
                .split_whitespace()
                .next()
                .and_then(|ns| ns.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(total)
}

/// Pins every thread of each Envoy to the last core; wrk runs on core 0.
fn pin(envoys: &[&Envoy]) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        return false;
    }
    envoys.iter().all(|envoy| {
        Command::new("taskset")
            .args([
                "-a",
                "-cp",
                &(cores - 1).to_string(),
                &envoy.pid().to_string(),
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

fn median(values: &[f64]) -> f64 {
    quantile(values, 0.5)
}

/// The `q` quantile, interpolated between the nearest ranks.
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n => {
            let at = q * (n - 1) as f64;
            let (low, high) = (at.floor() as usize, at.ceil() as usize);
            sorted[low] + (sorted[high] - sorted[low]) * (at - low as f64)
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct QosRefillArgs {
    /// Distinct client addresses to send from: one unstaked identity each.
    #[arg(long, default_value_t = 20_000)]
    pub identities: u32,
    /// How long wrk cycles through the addresses.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub concurrency: u32,
    /// The refill interval, in ms, instead of one sized from the rate
    /// measured first (to compare two builds at the same interval).
    #[arg(long)]
    pub refill_ms: Option<u64>,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/qos-refill")]
    pub out: PathBuf,
}

/// Envoy flushes histograms (and so their "interval" quantiles) every 5 s
/// by default; waiting a little longer makes a window without traffic.
const STATS_FLUSH: Duration = Duration::from_millis(5_500);

#[derive(Debug, Serialize)]
struct RefillPhase {
    phase: &'static str,
    identities: i64,
    rounds_per_s: f64,
    /// Refill round duration over the phase's stats window, in µs.
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    max_us: Option<f64>,
}

#[derive(Debug, Serialize)]
struct RefillSummary {
    identities_sent: u32,
    max_identities: u32,
    sizing: Sizing,
    concurrency: u32,
    phases: Vec<RefillPhase>,
}

/// A `maxIdentities` with room for `addresses`: identities hash into pages,
/// so a table sized exactly would evict from its fullest pages.
fn table_for(addresses: u32) -> u32 {
    addresses + addresses / 4 + stakegate_core::qos::page::ENTRIES_PER_PAGE as u32
}

/// The shortest refill interval the policy's refill budget allows for a
/// table of `max_identities` (20 ms, the default, when it fits).
fn refill_for(max_identities: u32) -> u64 {
    use stakegate_core::qos::policy::MAX_REFILL_VISITS_PER_S;
    (u64::from(max_identities) * 1000)
        .div_ceil(MAX_REFILL_VISITS_PER_S)
        .max(20)
}

/// How a run keeps `count` addresses active at the rate this machine
/// reaches. wrk sends from the addresses in turn, so each is seen once per
/// cycle of `count / rps` seconds. Stake QoS takes an identity whose demand
/// is under `IDLE_DEMAND` (0.01) calls per refill interval as idle (the
/// round skips it), and each round with calls moves the demand
/// `DEMAND_SMOOTHING` (a fifth) of the way to the calls' rate, a new
/// identity's first calls taken as spread over `FIRST_SAMPLE_MS`. So an
/// identity stays active while it calls 0.01 times per interval, a new one
/// starts active with an interval of 50 ms or more, and an idle one
/// calling less than 0.05 times per interval is active only in the rounds
/// with its calls. On a slow machine a table of 20,000 or 100,000 would
/// measure mostly idle identities: the interval is stretched until either
/// every address calls twice as often as it must to stay active and new
/// identities start active, or it calls twice as often as an idle one must
/// (at most the policy's 1 s); the idle TTL holds three cycles.
#[derive(Debug, Clone, Copy, Serialize)]
struct Sizing {
    /// What wrk reached through QoS from `count` addresses (the probe).
    measured_rps: f64,
    /// Seconds between two calls of one address.
    cycle_s: f64,
    refill_interval_ms: u64,
    idle_ttl_ms: u64,
}

impl Sizing {
    /// Sizes a table of `max_identities` (`refill_for` at the least) for
    /// `count` addresses at `rps`.
    fn of(count: u32, max_identities: u32, rps: f64) -> Self {
        use stakegate_core::qos::{DEMAND_SMOOTHING, FIRST_SAMPLE_MS, IDLE_DEMAND};
        let cycle_s = f64::from(count) / rps.max(1.0);
        // Calls per interval = interval / cycle.
        let cycle_ms = cycle_s * 1000.0;
        let stays = (2.0 * IDLE_DEMAND * cycle_ms)
            .max(2.0 * IDLE_DEMAND / DEMAND_SMOOTHING * FIRST_SAMPLE_MS as f64);
        let from_idle = 2.0 * IDLE_DEMAND / DEMAND_SMOOTHING * cycle_ms;
        let active_ms = stays.min(from_idle).ceil() as u64;
        Self {
            measured_rps: rps,
            cycle_s,
            refill_interval_ms: refill_for(max_identities).max(active_ms).min(1000),
            idle_ttl_ms: ((3.0 * cycle_s * 1000.0) as u64).max(60_000),
        }
    }

    /// Measures the rate: an Envoy with stake QoS identifying every call,
    /// `concurrency` workers, wrk cycling through `count` addresses for 3 s.
    fn measure(count: u32, max_identities: u32, concurrency: u32) -> anyhow::Result<Self> {
        let probe = Self::of(count, max_identities, f64::MAX);
        let envoy = qos_envoy(&probe.policy(1e7, max_identities), concurrency)?;
        if concurrency == 1 {
            // As the runs it sizes are.
            pin(&[&envoy]);
        }
        let script = tempfile::Builder::new().suffix(".lua").tempfile()?;
        std::fs::write(script.path(), addresses_script(count, 0))?;
        let run = wrk(
            &envoy.url("public")?,
            32,
            Duration::from_secs(3),
            script.path(),
            false,
        )?;
        Ok(Self::of(count, max_identities, run.rps))
    }

    /// A stake QoS policy identifying every request (`identifyAbove` 0),
    /// with client addresses from x-forwarded-for behind 127.0.0.1.
    fn policy(&self, capacity_rps: f64, max_identities: u32) -> String {
        format!(
            r#"{{"capacityRps": {capacity_rps}, "identifyAbove": 0, "maxIdentities": {max_identities}, "refillIntervalMs": {}, "idleTtlMs": {}, "reactive": {{"adjustIntervalMs": {}}}, "identity": {{"trustedProxies": ["127.0.0.1/32"]}}}}"#,
            self.refill_interval_ms,
            self.idle_ttl_ms,
            // Reactive mode (off here) adjusts no more often than it refills.
            self.refill_interval_ms.max(200)
        )
    }

    fn describe(&self) -> String {
        format!(
            "measured {:.0} rps, so an address calls every {:.1} s: refill every {} ms, idle TTL {} s",
            self.measured_rps,
            self.cycle_s,
            self.refill_interval_ms,
            self.idle_ttl_ms / 1000
        )
    }
}

/// One Envoy answering by itself behind stake QoS with `policy`.
fn qos_envoy(policy: &str, concurrency: u32) -> anyhow::Result<Envoy> {
    let qos = FilterConfig::stake_qos(paths::wasm_module("stake_qos")?, policy.to_string());
    direct(
        &[("public".into(), vec![Element::Wasm(qos)])],
        Answer::Itself,
    )?
    .concurrency(concurrency)
    .start()
}

/// `stakegate bench qos-refill`: how long one stake QoS refill round takes
/// in a real Envoy as the identity table fills. wrk sends from
/// `--identities` distinct addresses (in x-forwarded-for, behind a trusted
/// 127.0.0.1), at a capacity never reached, identifying every request
/// (`identifyAbove` 0: so far below capacity QoS would only count them), so
/// every address stays an identity until idleTtl; the filter's `refill_us` histogram gives each
/// phase's quantiles over one stats flush window: empty, while wrk sends,
/// and with the table full but no traffic.
pub fn qos_refill(args: &QosRefillArgs) -> anyhow::Result<()> {
    require_wrk()?;
    let max_identities = table_for(args.identities);
    let mut sizing = Sizing::measure(args.identities, max_identities, args.concurrency)?;
    if let Some(ms) = args.refill_ms {
        sizing.refill_interval_ms = ms;
    }
    let envoy = qos_envoy(
        &sizing.policy(1_000_000.0, max_identities),
        args.concurrency,
    )?;
    let url = envoy.url("public")?;
    let script = tempfile::Builder::new().suffix(".lua").tempfile()?;
    std::fs::write(script.path(), addresses_script(args.identities, 0))?;
    println!(
        "qos refill: {} addresses through Envoy --concurrency {} (maxIdentities {max_identities}); {}",
        args.identities,
        args.concurrency,
        sizing.describe()
    );
    let mut phases = Vec::new();
    let mut measure = |phase: &'static str, window: Duration| -> anyhow::Result<()> {
        let rounds = envoy.stat("wasmcustom.stakegate.qos.rounds")?;
        std::thread::sleep(window);
        let quantile = |q: f64, quantiles: &[Quantile]| {
            quantiles
                .iter()
                .find(|x| x.percent == q)
                .and_then(|x| x.interval)
        };
        let refill = envoy
            .admin()
            .histogram("wasmcustom.stakegate.qos.refill_us")?;
        let rounds = envoy.stat("wasmcustom.stakegate.qos.rounds")? - rounds;
        let result = RefillPhase {
            phase,
            identities: envoy.stat("wasmcustom.stakegate.qos.identities")?,
            rounds_per_s: rounds as f64 / window.as_secs_f64(),
            p50_us: quantile(50.0, &refill),
            p99_us: quantile(99.0, &refill),
            max_us: quantile(100.0, &refill),
        };
        let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        println!(
            "{:<8} identities {:>7}   rounds {:>5.1}/s   refill p50 {:>6} µs   p99 {:>6} µs   max {:>6} µs",
            result.phase,
            result.identities,
            result.rounds_per_s,
            us(result.p50_us),
            us(result.p99_us),
            us(result.max_us)
        );
        phases.push(result);
        Ok(())
    };
    measure("empty", STATS_FLUSH)?;
    let sender = std::thread::scope(|scope| {
        let sending = scope.spawn(|| wrk(&url, 16, args.duration, script.path(), false));
        // The last full flush window inside wrk's run.
        std::thread::sleep(args.duration.saturating_sub(STATS_FLUSH));
        let loaded = measure("loaded", STATS_FLUSH);
        (sending.join(), loaded)
    });
    let rps = match sender {
        (Ok(rps), loaded) => {
            loaded?;
            rps?.rps
        }
        (Err(_), _) => bail!("the wrk thread panicked"),
    };
    println!("wrk sent {rps:.0} rps");
    measure("idle", STATS_FLUSH)?;
    let summary = RefillSummary {
        identities_sent: args.identities,
        max_identities,
        sizing,
        concurrency: args.concurrency,
        phases,
    };
    crate::summary::write(&args.out, &summary)
}

/// A wrk script that POSTs eth_blockNumber from `count` addresses in turn
/// (10.0.0.0 upwards), each in x-forwarded-for.
fn addresses_script(count: u32, start: u64) -> String {
    format!(
        r#"local n = {start}
local body = '{{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}}'
request = function()
  local i = n % {count}
  n = n + 1
  local address = string.format("10.%d.%d.%d", math.floor(i / 65536) % 256, math.floor(i / 256) % 256, i % 256)
  return wrk.format("POST", "/", {{["content-type"] = "application/json", ["x-forwarded-for"] = address}}, body)
end
"#
    )
}

#[derive(Debug, Clone, clap::Args)]
pub struct QosScaleArgs {
    /// Identity counts to compare (distinct client addresses).
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000,100000")]
    pub identities: Vec<u32>,
    /// Rounds (each runs every Envoy once).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Length of one wrk run.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// wrk connections.
    #[arg(long, default_value_t = 32)]
    pub connections: u32,
    /// Where summary.json goes.
    #[arg(long, default_value = "results/qos-scale")]
    pub out: PathBuf,
}

/// The two ways stake QoS runs with identities (`identifyAbove` 0): below
/// its threshold every request is identified and admitted without shared
/// data; over it (capacity far below what wrk
/// sends) every identity takes token leases from its page and most
/// requests are refused.
const SCALE_MODES: [(&str, f64); 2] = [("below", 10_000_000.0), ("throttling", 1_000.0)];

#[derive(Debug, Serialize)]
struct ScaleResult {
    mode: &'static str,
    identities_sent: u32,
    /// The most identities with demand at once (an Envoy waiting its turn
    /// sees its identities go idle, so the gauge after a run is lower).
    identities: i64,
    rps: Vec<f64>,
    median_rps: f64,
    /// Median of the per-round ratio to the fewest identities, same mode.
    median_ratio: f64,
    ratio_iqr: [f64; 2],
    rss_mib: f64,
}

#[derive(Debug, Serialize)]
struct ScaleSummary {
    machine: String,
    rounds: usize,
    duration_s: f64,
    connections: u32,
    max_identities: u32,
    sizing: Sizing,
    pinned: bool,
    results: Vec<ScaleResult>,
}

/// One Envoy of `qos-scale`, and how far wrk has got through its addresses
/// (each run starts where the last stopped, so every address is sent).
struct ScaleRun {
    mode: &'static str,
    count: u32,
    envoy: Envoy,
    script: tempfile::NamedTempFile,
    sent: u64,
    /// The most identities with demand seen at once.
    peak: i64,
}

impl ScaleRun {
    fn send(&mut self, connections: u32, duration: Duration) -> anyhow::Result<Run> {
        let start = self.sent % u64::from(self.count);
        std::fs::write(self.script.path(), addresses_script(self.count, start))?;
        let url = self.envoy.url("public")?;
        let run = wrk(
            &url,
            connections,
            duration,
            self.script.path(),
            self.mode != "below",
        )?;
        self.sent += run.requests;
        Ok(run)
    }

    /// Sends until every address has been sent and the identity gauge
    /// holds 95 % of them, for at most three cycles through the addresses
    /// (and 30 s) at the measured rate; a table that does not fill by then
    /// is said, and measured as it is (its peak is in the summary).
    fn warm_up(&mut self, connections: u32, sizing: &Sizing) -> anyhow::Result<()> {
        let limit = Duration::from_secs_f64(3.0 * sizing.cycle_s + 30.0);
        let started = Instant::now();
        loop {
            let active = self.identities()?;
            let filled = active >= i64::from(self.count) * 95 / 100;
            if filled && self.sent >= u64::from(self.count) {
                return Ok(());
            }
            if started.elapsed() > limit {
                eprintln!(
                    "warning: {} {}: {active} of {} addresses active after {limit:?} of warm-up; measured as it is",
                    self.mode, self.count, self.count
                );
                return Ok(());
            }
            let sent = self.send(connections, Duration::from_secs(2))?;
            eprintln!(
                "warm-up: {} {}: {:.0} rps, {active} active before",
                self.mode, self.count, sent.rps
            );
        }
    }

    /// The identity gauge now (identities with demand in the last round).
    fn identities(&mut self) -> anyhow::Result<i64> {
        let now = self.envoy.stat("wasmcustom.stakegate.qos.identities")?;
        self.peak = self.peak.max(now);
        Ok(now)
    }
}

/// `stakegate bench qos-scale`: requests per second through stake QoS at
/// each identity count, and Envoy's memory, from one run. One Envoy
/// (`--concurrency 1`) per count and mode, all with the same policy: a
/// table for the largest count, refilled as often as the page budget
/// allows. wrk cycles through the addresses (x-forwarded-for behind a
/// trusted 127.0.0.1); each Envoy is warmed up until its identity gauge
/// holds the addresses, then the Envoys take turns, round after round, the
/// others stopped while one is measured (`Turns`).
pub fn qos_scale(args: &QosScaleArgs) -> anyhow::Result<()> {
    require_wrk()?;
    let largest = args
        .identities
        .iter()
        .copied()
        .max()
        .context("no --identities")?;
    let max_identities = table_for(largest);
    // The slower mode (identifying and admitting) sets the rate.
    let sizing = Sizing::measure(largest, max_identities, 1)?;
    let mut runs = Vec::new();
    for (mode, capacity) in SCALE_MODES {
        for &count in &args.identities {
            runs.push(ScaleRun {
                mode,
                count,
                envoy: qos_envoy(&sizing.policy(capacity, max_identities), 1)?,
                script: tempfile::Builder::new().suffix(".lua").tempfile()?,
                sent: 0,
                peak: 0,
            });
        }
    }
    let pinned = pin(&runs.iter().map(|r| &r.envoy).collect::<Vec<_>>());
    println!(
        "qos scale: {:?} identities, wrk -c{} for {:?} per Envoy and round, {} rounds, maxIdentities {max_identities}, on {}; {}",
        args.identities,
        args.connections,
        args.duration,
        args.rounds,
        machine(),
        sizing.describe()
    );
    let turns = Turns::of(&runs.iter().map(|r| r.envoy.pid()).collect::<Vec<_>>());
    for run in &mut runs {
        turns.only(run.envoy.pid())?;
        run.warm_up(args.connections, &sizing)?;
    }
    let mut rps = vec![Vec::new(); runs.len()];
    for round in 1..=args.rounds {
        for (i, run) in runs.iter_mut().enumerate() {
            turns.only(run.envoy.pid())?;
            rps[i].push(run.send(args.connections, args.duration)?.rps);
            run.identities()?;
        }
        let line: Vec<String> = runs
            .iter()
            .zip(&rps)
            .map(|(run, r)| format!("{} {} {:.0}", run.mode, run.count, r[round - 1]))
            .collect();
        println!("round {round}: {}", line.join(", "));
    }
    let mut results = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let base = runs.iter().position(|r| r.mode == run.mode).unwrap_or(i);
        let ratios: Vec<f64> = rps[i].iter().zip(&rps[base]).map(|(a, b)| a / b).collect();
        results.push(ScaleResult {
            mode: run.mode,
            identities_sent: run.count,
            identities: run.peak,
            median_rps: median(&rps[i]),
            median_ratio: median(&ratios),
            ratio_iqr: [quantile(&ratios, 0.25), quantile(&ratios, 0.75)],
            rss_mib: rss_kib(run.envoy.pid())? as f64 / 1024.0,
            rps: rps[i].clone(),
        });
    }
    let mut table = format!(
        "\n{:<11} {:>10} {:>10} {:>10} {:>14} {:>17} {:>9}\n",
        "mode", "addresses", "peak", "rps", "vs the fewest", "IQR", "RSS MiB"
    );
    for r in &results {
        table.push_str(&format!(
            "{:<11} {:>10} {:>10} {:>10.0} {:>14.3} {:>17} {:>9.1}\n",
            r.mode,
            r.identities_sent,
            r.identities,
            r.median_rps,
            r.median_ratio,
            format!("{:.3}-{:.3}", r.ratio_iqr[0], r.ratio_iqr[1]),
            r.rss_mib
        ));
    }
    println!("{table}");
    crate::summary::write(
        &args.out,
        &ScaleSummary {
            machine: machine(),
            rounds: args.rounds,
            duration_s: args.duration.as_secs_f64(),
            connections: args.connections,
            max_identities,
            sizing,
            pinned,
            results,
        },
    )
}

/// Envoys taking turns on one core: all but the one measured are stopped
/// (`SIGSTOP`), so that an idle Envoy's refill rounds (at 100,000
/// identities, milliseconds every interval while its table decays) take
/// none of the measured one's time, and its table waits for its next turn
/// as it was. All go on again when this is dropped.
struct Turns {
    pids: Vec<u32>,
}

impl Turns {
    fn of(pids: &[u32]) -> Self {
        Self {
            pids: pids.to_vec(),
        }
    }

    /// Lets `pid` run and stops the others.
    fn only(&self, pid: u32) -> anyhow::Result<()> {
        for &other in &self.pids {
            signal(other, if other == pid { "CONT" } else { "STOP" })?;
        }
        Ok(())
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        for &pid in &self.pids {
            let _ = signal(pid, "CONT");
        }
    }
}

fn signal(pid: u32, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed");
    Ok(())
}

/// A process's resident memory, from /proc.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/<pid>/status")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_machine_stretches_the_refill_interval_to_keep_its_addresses_active() {
        let table = table_for(100_000);
        // Fast enough: the page budget's interval keeps every address active.
        let fast = Sizing::of(100_000, table, 200_000.0);
        assert_eq!(fast.refill_interval_ms, refill_for(table));
        assert_eq!(fast.idle_ttl_ms, 60_000);
        // 20,000 addresses at 24,000 rps: one call every 0.83 s, so 0.1
        // calls a round (any identity becomes active) is an 84 ms round,
        // shorter than the 100 ms at which new ones start active.
        let slow = Sizing::of(20_000, table_for(20_000), 24_000.0);
        assert_eq!(slow.refill_interval_ms, 84);
        let calls_per_round = slow.refill_interval_ms as f64 / 1000.0 / slow.cycle_s;
        assert!(calls_per_round >= 0.1, "{calls_per_round}");
        // 100,000 at 7,000 rps: one call every 14.3 s; 0.02 calls a round
        // (twice what keeps one active) is a 286 ms round, over 100 ms.
        assert_eq!(Sizing::of(100_000, table, 7_000.0).refill_interval_ms, 286);
        // Slower: capped at the policy's longest interval; the TTL holds
        // three cycles.
        let crawl = Sizing::of(100_000, table, 500.0);
        assert_eq!(crawl.refill_interval_ms, 1000);
        assert_eq!(crawl.idle_ttl_ms, 600_000);
    }
}
