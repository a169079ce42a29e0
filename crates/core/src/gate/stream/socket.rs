//! A stream that is a WebSocket, as the registry reaches it: stake QoS's
//! word on holding its data goes to it, and what it sent and had answered
//! goes back to QoS.

use super::{GateStream, State};
use crate::gate::websocket::Websocket;

impl GateStream {
    /// Its WebSocket, if it is one.
    pub fn socket(&self) -> Option<&Websocket> {
        match &self.state {
            State::Websocket(ws) => Some(ws),
            _ => None,
        }
    }

    /// Its WebSocket, to change, if it is one.
    pub fn socket_mut(&mut self) -> Option<&mut Websocket> {
        match &mut self.state {
            State::Websocket(ws) => Some(ws),
            _ => None,
        }
    }
}
