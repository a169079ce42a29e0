//! Client latency as a TCP relay: every byte a client sends reaches Envoy
//! half a round trip late, and every byte back reaches the client half a
//! round trip late, in order, as on a long path.
//!
//! This stands in for `tc netem`, which the kernels these runs target may
//! lack (no `sch_netem`, no modules). Envoy sees the relay's address
//! (127.0.0.1) as the client's, so clients behind a relay are told apart by
//! API key, not by address.

use anyhow::Context;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A relay on 127.0.0.1 to `upstream`; it stops when dropped.
#[derive(Debug)]
pub struct DelayRelay {
    addr: SocketAddr,
    _runtime: tokio::runtime::Runtime,
}

impl DelayRelay {
    pub fn start(upstream: SocketAddr, round_trip: Duration) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("delay-relay")
            .enable_all()
            .build()?;
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .context("binding the delay relay")?;
        let addr = listener.local_addr()?;
        let one_way = round_trip / 2;
        runtime.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return; // the client sees the connection close
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        pump(client_read, server_write, one_way),
                        pump(server_read, client_write, one_way)
                    );
                });
            }
        });
        Ok(Self {
            addr,
            _runtime: runtime,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read; a close
/// is passed on after the last chunk.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
        // Dropping `tx` ends the writer once it has sent everything.
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn bytes_arrive_a_round_trip_late_and_in_order() {
        let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = echo.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = echo.accept().unwrap();
            let mut buf = [0; 1024];
            while let Ok(n @ 1..) = conn.read(&mut buf) {
                conn.write_all(&buf[..n]).unwrap();
            }
        });
        let relay = DelayRelay::start(upstream, Duration::from_millis(200)).unwrap();
        let mut conn = std::net::TcpStream::connect(relay.addr()).unwrap();
        let sent = std::time::Instant::now();
        conn.write_all(b"one,").unwrap();
        conn.write_all(b"two").unwrap();
        let mut got = Vec::new();
        let mut buf = [0; 16];
        while got.len() < 7 {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "closed early");
            got.extend_from_slice(&buf[..n]);
        }
        let took = sent.elapsed();
        assert_eq!(got, b"one,two");
        assert!(took >= Duration::from_millis(200), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
