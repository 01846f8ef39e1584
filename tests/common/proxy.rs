//! A fault-injecting HTTP/1.1 proxy on loopback, in front of DynamoDB Local: for requests
//! whose `X-Amz-Target` matches, it answers with a throttling or 5xx error at a given rate
//! instead of forwarding. Bounded: at most `max_faults` faults, and it stops when dropped.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One kind of fault: HTTP status and AWS error type.
#[derive(Clone, Debug)]
pub struct Fault {
    /// Substring of X-Amz-Target that the fault applies to (e.g. "UpdateItem").
    pub target: &'static str,
    pub status: u16,
    pub error_type: &'static str,
    /// Probability per matching request.
    pub rate: f64,
}

pub struct FaultProxy {
    pub port: u16,
    pub injected: Arc<AtomicU64>,
    pub forwarded: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

pub async fn start(upstream_port: u16, faults: Vec<Fault>, max_faults: u64) -> FaultProxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let injected = Arc::new(AtomicU64::new(0));
    let forwarded = Arc::new(AtomicU64::new(0));
    let (inj, fwd) = (injected.clone(), forwarded.clone());
    let faults = Arc::new(faults);
    let task = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else { continue };
            let (inj, fwd, faults) = (inj.clone(), fwd.clone(), faults.clone());
            tokio::spawn(async move {
                let _ = serve(client, upstream_port, &faults, max_faults, &inj, &fwd).await;
            });
        }
    });
    FaultProxy { port, injected, forwarded, task }
}

/// Reads more bytes into `buf`; false at end of stream.
async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    let mut chunk = [0u8; 16384];
    let n = s.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

/// Length of a complete chunked body at the start of `body`, if it is all there.
fn chunked_len(body: &[u8]) -> Option<usize> {
    let mut pos = 0;
    loop {
        let line_end = body[pos..].windows(2).position(|w| w == b"\r\n")? + pos;
        let size_text = String::from_utf8_lossy(&body[pos..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        pos = line_end + 2;
        if size == 0 {
            // Trailers end with an empty line.
            let end = body[pos..].windows(2).position(|w| w == b"\r\n")? + pos;
            if end == pos {
                return Some(pos + 2);
            }
            let blank = body[pos..].windows(4).position(|w| w == b"\r\n\r\n")? + pos;
            return Some(blank + 4);
        }
        pos += size + 2;
        if pos > body.len() {
            return None;
        }
    }
}

/// Reads one HTTP message (head + body by Content-Length or chunked) from `s` into `buf`.
async fn read_message(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Option<(String, Vec<u8>)>> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let header = |name: &str| {
                head.lines().find_map(|l| {
                    l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_ascii_lowercase())
                })
            };
            let body_start = end + 4;
            let total = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                loop {
                    if let Some(n) = chunked_len(&buf[body_start..]) {
                        break body_start + n;
                    }
                    if !fill(s, buf).await? {
                        return Ok(None);
                    }
                }
            } else {
                body_start + header("content-length").and_then(|v| v.parse::<usize>().ok()).unwrap_or(0)
            };
            while buf.len() < total {
                if !fill(s, buf).await? {
                    return Ok(None);
                }
            }
            let message: Vec<u8> = buf.drain(..total).collect();
            return Ok(Some((head, message)));
        }
        if !fill(s, buf).await? {
            return Ok(None);
        }
    }
}

async fn serve(
    mut client: TcpStream,
    upstream_port: u16,
    faults: &[Fault],
    max_faults: u64,
    injected: &AtomicU64,
    forwarded: &AtomicU64,
) -> std::io::Result<()> {
    let mut upstream: Option<TcpStream> = None;
    let (mut cbuf, mut ubuf) = (Vec::new(), Vec::new());
    // Bounded: a connection serves at most 100,000 requests.
    for _ in 0..100_000 {
        let Some((head, request)) = read_message(&mut client, &mut cbuf).await? else { return Ok(()) };
        let target = head
            .lines()
            .find_map(|l| {
                l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case("x-amz-target")).map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_default();
        let fault = faults.iter().find(|f| target.contains(f.target) && fastrand::f64() < f.rate);
        if let Some(f) = fault {
            if injected.fetch_add(1, Ordering::SeqCst) < max_faults {
                let body =
                    format!(r#"{{"__type":"com.amazonaws.dynamodb.v20120810#{}","message":"injected by the test proxy"}}"#, f.error_type);
                let reason = if f.status == 400 { "Bad Request" } else { "Internal Server Error" };
                let resp = format!(
                    "HTTP/1.1 {} {reason}\r\nContent-Type: application/x-amz-json-1.0\r\nx-amzn-RequestId: proxy-{}\r\nx-amzn-ErrorType: {}\r\nContent-Length: {}\r\n\r\n{body}",
                    f.status,
                    fastrand::u64(..),
                    f.error_type,
                    body.len()
                );
                client.write_all(resp.as_bytes()).await?;
                continue;
            }
            injected.fetch_sub(1, Ordering::SeqCst);
        }
        if upstream.is_none() {
            upstream = Some(TcpStream::connect(("127.0.0.1", upstream_port)).await?);
        }
        let Some(up) = upstream.as_mut() else { return Ok(()) };
        up.write_all(&request).await?;
        let Some((_, response)) = read_message(up, &mut ubuf).await? else { return Ok(()) };
        forwarded.fetch_add(1, Ordering::SeqCst);
        client.write_all(&response).await?;
    }
    Ok(())
}
