//! `stakegate-probe URL`: exits 0 if `GET URL` answers 200, else 1 with
//! the reason on stderr. The compose stack's healthchecks run it inside
//! images that are not ours (Envoy's, Prometheus's, Redis's), so it is a
//! static binary with nothing but the standard library: plain HTTP/1.1 to
//! `http://HOST:PORT/PATH`, a 2 s budget to connect and 2 s to answer.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: stakegate-probe http://HOST:PORT/PATH");
        return ExitCode::from(2);
    };
    match probe(&url) {
        Ok(()) => ExitCode::SUCCESS,
        Err(reason) => {
            eprintln!("{url}: {reason}");
            ExitCode::FAILURE
        }
    }
}

/// `url`'s host and port, and its path (`/` if none).
fn split(url: &str) -> Result<(&str, &str), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are probed")?;
    Ok(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    })
}

fn probe(url: &str) -> Result<(), String> {
    let (authority, path) = split(url)?;
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {authority}: {e}"))?
        .next()
        .ok_or_else(|| format!("{authority} has no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    // The status line is all it needs: "HTTP/1.1 200 OK".
    let mut head = [0u8; 64];
    let mut read = 0;
    while read < 12 {
        match stream.read(&mut head[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) => return Err(e.to_string()),
        }
    }
    let line = String::from_utf8_lossy(&head[..read]);
    match line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        Some(status) => Err(format!("answered {status}")),
        None => Err("no HTTP answer".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server on a free port that answers one request with `status`.
    fn answering(status: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n").as_bytes());
        });
        format!("http://{addr}/ready")
    }

    #[test]
    fn a_200_passes_and_anything_else_says_why() {
        assert_eq!(probe(&answering("200 OK")), Ok(()));
        assert_eq!(
            probe(&answering("503 Service Unavailable")),
            Err("answered 503".into())
        );
        assert!(probe("https://127.0.0.1:1/").is_err());
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(
            probe(&format!("http://{closed}/")).is_err(),
            "nothing listens"
        );
        assert_eq!(split("http://a:1").unwrap(), ("a:1", "/"));
    }
}
