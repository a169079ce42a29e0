//! A VM's wake queue and the wake queues of the other VMs of its `vm_id`
//! (proxy-wasm shared queues, by name): what the gate's VMs tell each
//! other travels on them.

use crate::host;
use std::collections::HashMap;

/// This VM's queue, and the others' it has resolved.
#[derive(Debug, Default)]
pub struct WakeQueues {
    own: Option<u32>,
    /// A wake-up is on this VM's own queue, not yet read.
    poked: bool,
    vm_id: String,
    /// Other VMs' queues, by VM number.
    peers: HashMap<u32, u32>,
}

impl WakeQueues {
    /// Queues of the VMs of this plugin's `vm_id`.
    pub fn new() -> Self {
        Self {
            vm_id: crate::property_string(&["plugin_vm_id"]).unwrap_or_default(),
            ..Self::default()
        }
    }

    /// Registers this VM's queue as `name`, once a name is known.
    pub fn register(&mut self, name: Option<String>) {
        if let (None, Some(name)) = (self.own, name) {
            self.own = host::register_queue(&name);
        }
    }

    /// Puts an empty message on this VM's own queue, unless one is on it:
    /// its root context then runs `on_queue_ready`.
    pub fn poke(&mut self) {
        if let (Some(queue), false) = (self.own, self.poked) {
            self.poked = host::enqueue(queue, &[]);
        }
    }

    /// This VM's queue is being read.
    pub fn read(&mut self) {
        self.poked = false;
    }

    /// Puts `message` on the queue named `name(vm)` of each of `vms`; a VM
    /// whose queue is gone is forgotten (and resolved again next time).
    pub fn send(&mut self, vms: &[u32], name: impl Fn(u32) -> String, message: &[u8]) {
        for &vm in vms {
            let queue = match self.peers.get(&vm) {
                Some(queue) => Some(*queue),
                None => host::resolve_queue(&self.vm_id, &name(vm)),
            };
            match queue {
                Some(queue) if host::enqueue(queue, message) => {
                    self.peers.insert(vm, queue);
                }
                _ => {
                    self.peers.remove(&vm);
                }
            }
        }
    }
}
