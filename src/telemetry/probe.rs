//! `ddb-aggregator healthcheck`: one GET of the service's `/healthz`, for container health
//! checks where the image has no shell or curl (distroless on ECS).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("{0:?} is not an address like http://127.0.0.1:9464/healthz")]
    BadUrl(String),
    #[error("cannot reach {0}: {1}")]
    Io(String, String),
    #[error("{0} answered {1:?}")]
    Unhealthy(String, String),
}

/// (host:port, path) of a plain `http://` address; the path defaults to `/healthz`.
pub fn parse(url: &str) -> Result<(String, String), ProbeError> {
    let bad = || ProbeError::BadUrl(url.to_string());
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/healthz"),
    };
    let port_ok = authority.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok || authority.contains('@') || path.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok((authority.to_string(), path.to_string()))
}

/// GETs `url`; Ok on a 2xx answer within `timeout`.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), ProbeError> {
    let (authority, path) = parse(url)?;
    let io = |e: std::io::Error| ProbeError::Io(authority.clone(), e.to_string());
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(&authority).await.map_err(io)?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.map_err(io)?;
        let mut answer = Vec::new();
        conn.take(64 * 1024).read_to_end(&mut answer).await.map_err(io)?;
        let text = String::from_utf8_lossy(&answer);
        let status = text.lines().next().unwrap_or("").to_string();
        match status.split(' ').nth(1) {
            Some(code) if code.starts_with('2') => Ok(()),
            _ => Err(ProbeError::Unhealthy(url.to_string(), status)),
        }
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| ProbeError::Io(authority.clone(), format!("no answer within {timeout:?}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse("http://127.0.0.1:9464/healthz"), Ok(("127.0.0.1:9464".into(), "/healthz".into())));
        assert_eq!(parse("http://localhost:9464"), Ok(("localhost:9464".into(), "/healthz".into())));
        for bad in ["127.0.0.1:9464", "https://x:1/healthz", "http://x/healthz", "http://:9/", "http://x:99999/", "http://a@b:1/"] {
            assert_eq!(parse(bad), Err(ProbeError::BadUrl(bad.into())), "{bad}");
        }
    }
}
