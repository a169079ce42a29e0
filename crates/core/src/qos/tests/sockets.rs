//! Calls on WebSockets in virtual time: let on for their identity's share
//! (the gate holding the socket's data while QoS says so), charged their
//! estimates, settled to what the node took, against an HTTP flood of the
//! same method and stake.

use super::*;
use crate::cost::{method_key, SocketAnswered};
use crate::qos::report::MemoryQueue;
use crate::qos::socket::Socket;
use crate::request::testing::Bytes;
use crate::shared::MemoryStore;
use crate::websocket::{encode, OPCODE_TEXT};

const COST_MS: u64 = 40;

/// One socket as the gate and the node see it: the client's bytes the
/// gate holds (while QoS says they wait), the calls at the
/// node (when each is done), and what the gate has said of them. As in
/// Envoy, the gate reads QoS's word as data comes and at its own ticks,
/// not the moment QoS changes it.
struct Line {
    socket: Socket,
    vm: usize,
    at_gate: Vec<u8>,
    /// Calls the client has out (at the gate, or at the node).
    out: u32,
    at_node: Vec<u64>,
    answered: SocketAnswered,
    /// QoS's word, and the gate's reading of it.
    held: bool,
    gate_held: bool,
}

fn call(n: u64) -> Vec<u8> {
    let text = format!(r#"{{"jsonrpc":"2.0","id":{n},"method":"eth_getProof","params":[]}}"#);
    encode(OPCODE_TEXT, text.as_bytes(), Some([1, 2, 3, 4]))
}

impl Line {
    /// QoS's word on the socket, if it changed.
    fn told(&mut self, hold: Option<bool>) {
        if let Some(hold) = hold {
            self.held = hold;
        }
    }

    /// The gate sends what it holds unless QoS says wait: each call at the
    /// node for `COST_MS`.
    fn gate(&mut self, now_us: u64) {
        if self.gate_held {
            return;
        }
        let calls = self.at_gate.len() / call(0).len();
        self.at_gate.clear();
        self.answered.sent += calls as u64;
        for _ in 0..calls {
            self.at_node.push(now_us + COST_MS * 1000);
        }
    }
}

/// Two workers; an HTTP flood (key 1) and 6 sockets each keeping 8 calls
/// out (key 2), equal stakes, every call `COST_MS` at the node: the node
/// time each got from `from_ms` on; the sockets' node time in all, and
/// what their identity's ledger says.
fn flood(run_ms: u64, from_ms: u64) -> ([u64; 2], u64, u64) {
    let policy =
        QosPolicy::parse(br#"{"capacityNodeMs": 4000, "costs": {"eth_getProof": 40}}"#).unwrap();
    let store = MemoryStore::default();
    let queue = MemoryQueue::default();
    let mut vms: Vec<StakeQos> = (0..3)
        .map(|i| StakeQos::new(policy.clone(), i + 1))
        .collect();
    let (http, ws) = (identity(1, 25_000_000), identity(2, 25_000_000));
    let mut lines: Vec<Line> = (0..6)
        .map(|i| {
            let vm = 1 + i % 2;
            let Verdict::Admit(ticket) = vms[vm].admit_at(&store, 0, &ws).verdict else {
                unreachable!("below the threshold")
            };
            let connection = vms[vm].upgraded(ticket).unwrap();
            Line {
                socket: Socket::new(connection, ws.clone()),
                vm,
                at_gate: Vec::new(),
                out: 0,
                at_node: Vec::new(),
                answered: SocketAnswered::default(),
                held: false,
                gate_held: false,
            }
        })
        .collect();
    let mut node_us = [0u64; 2];
    let mut sockets_us = 0;
    let mut pending: Vec<(u64, usize, Ticket)> = Vec::new();
    let mut n = 0;
    for now in 1..=run_ms {
        let now_us = now * 1000;
        let counted = now >= from_ms;
        let tick = now % 20 == 0;
        if tick {
            for vm in &mut vms {
                vm.tick(&store, &queue, now).unwrap();
            }
        }
        // HTTP: 400 calls a second, each admitted or refused.
        for (_, vm, mut ticket) in pending.extract_if(.., |p| p.0 <= now_us) {
            vms[vm].answered(&mut ticket, COST_MS * 1000, Some(200));
            node_us[0] += u64::from(counted) * COST_MS * 1000;
            vms[vm].finish(now, ticket, Some(200));
        }
        if now % 5 < 2 {
            let vm = 1 + (now as usize / 5) % 2;
            if let Verdict::Admit(mut ticket) = vms[vm].admit_at(&store, now_us, &http).verdict {
                vms[vm].charge_cost(&mut ticket, 40 * MILLI, 1, Some(method_key("eth_getProof")));
                pending.push((now_us + COST_MS * 1000, vm, ticket));
            }
        }
        // Sockets: answers pass (the gate's word), the client sends more.
        for line in &mut lines {
            let qos = &mut vms[line.vm];
            let done = line.at_node.extract_if(.., |t| *t <= now_us).count() as u64;
            if done > 0 {
                line.out -= done as u32;
                line.answered.calls += done;
                line.answered.node_us += done * COST_MS * 1000;
                node_us[1] += u64::from(counted) * done * COST_MS * 1000;
                sockets_us += done * COST_MS * 1000;
                line.socket.answered(qos, now_us, line.answered);
            }
            while line.out < 8 {
                n += 1;
                line.out += 1;
                let bytes = call(n);
                let size = bytes.len();
                line.socket.answered(qos, now_us, line.answered);
                let read = line
                    .socket
                    .read(qos, &store, now_us, &mut Bytes(bytes.clone()), size);
                line.told(read.1.hold);
                line.gate_held = line.held;
                line.at_gate.extend(bytes);
            }
            if tick && line.socket.holding() {
                line.socket.answered(qos, now_us, line.answered);
                let charged = line.socket.tick(qos, &store, now_us);
                line.told(charged.hold);
            }
            // The gate's own ticks, between QoS's.
            if now % 20 == 10 {
                line.gate_held = line.held;
            }
            line.gate(now_us);
        }
    }
    let ledger = vms
        .iter()
        .map(|v| v.locals.get(&2).map_or(0, |l| l.usage.node_us))
        .sum();
    (node_us, sockets_us, ledger)
}

/// A flood of heavy calls on sockets gets its identity's share of the
/// node's time, as the same flood over HTTP does; before, its calls were
/// never held and took about 1.7 times its share.
#[test]
fn a_socket_flood_gets_its_share_of_node_time_and_is_charged_what_it_took() {
    let (run_ms, from_ms) = (8000, 3000);
    let (node_us, sockets_us, ledger) = flood(run_ms, from_ms);
    let seconds = (run_ms - from_ms) as f64 / 1000.0;
    let ms = node_us.map(|us| us as f64 / 1000.0 / seconds);
    let socket_share = ms[1] / (ms[0] + ms[1]);
    eprintln!(
        "node ms/s: HTTP {:.0}, sockets {:.0} ({socket_share:.3})",
        ms[0], ms[1]
    );
    assert!((socket_share - 0.5).abs() < 0.03, "{ms:?}");
    assert!(ms[0] + ms[1] >= 0.9 * 4000.0, "{ms:?}");
    // The ledger: every call the sockets' identity got, at what it took.
    assert_eq!(ledger, sockets_us);
}
