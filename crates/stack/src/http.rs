//! Small blocking HTTP calls for admin endpoints and test requests.

use std::time::Duration;

/// A status and body. Non-2xx statuses are answers, not errors; only
/// transport failures are errors.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_str(&self.body)
            .map_err(|e| anyhow::anyhow!("body is not JSON ({e}): {}", self.body))
    }
}

fn agent() -> ureq::Agent {
    agent_within(Duration::from_secs(30))
}

fn agent_within(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(timeout).build()
}

fn answer(result: Result<ureq::Response, ureq::Error>) -> anyhow::Result<Answer> {
    let (status, headers, body) = raw(result)?;
    Ok(Answer {
        status,
        headers,
        body: String::from_utf8(body)?,
    })
}

/// A status, headers and body bytes (an encoded body as it came).
pub type Raw = (u16, Vec<(String, String)>, Vec<u8>);

fn raw(result: Result<ureq::Response, ureq::Error>) -> anyhow::Result<Raw> {
    let response = match result {
        Ok(response) | Err(ureq::Error::Status(_, response)) => response,
        Err(e) => return Err(e.into()),
    };
    let status = response.status();
    let headers = response
        .headers_names()
        .into_iter()
        .filter_map(|name| {
            let value = response.header(&name)?.to_string();
            Some((name, value))
        })
        .collect();
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut response.into_reader(), &mut body)?;
    Ok((status, headers, body))
}

/// POSTs `body` with the given extra headers; the answer's body as bytes.
pub fn post_raw(url: &str, headers: &[(&str, &str)], body: &str) -> anyhow::Result<Raw> {
    let mut request = agent().post(url).set("content-type", "application/json");
    for (name, value) in headers {
        request = request.set(name, value);
    }
    raw(request.send_string(body))
}

pub fn get(url: &str) -> anyhow::Result<Answer> {
    answer(agent().get(url).call())
}

/// POSTs `body` with the given extra headers.
pub fn post(url: &str, headers: &[(&str, &str)], body: &str) -> anyhow::Result<Answer> {
    post_with(agent(), url, headers, body)
}

/// POSTs `body` as a client that gives up (closing its connection) after
/// `timeout`.
pub fn post_within(url: &str, body: &str, timeout: Duration) -> anyhow::Result<Answer> {
    post_with(agent_within(timeout), url, &[], body)
}

fn post_with(
    agent: ureq::Agent,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Answer> {
    let mut request = agent.post(url).set("content-type", "application/json");
    for (name, value) in headers {
        request = request.set(name, value);
    }
    answer(request.send_string(body))
}
