//! A fault-injecting HTTP/1.1 proxy on loopback, in front of DynamoDB Local (and its streams)
//! or the SQS server. Three policies: [`start`] answers requests whose `X-Amz-Target` matches
//! with a throttling or 5xx error at a given rate; [`start_chaos`] hits every call at one
//! rate with a fault chosen among those the call can meet in production (errors, dropped
//! connections before or after forwarding, delays); [`start_refusing_sqs_bodies`] refuses
//! SQS messages holding given bytes, as SQS refuses characters outside its set (moto takes
//! anything). Bounded: at most `max_faults` faults, and it stops when dropped.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    /// Faults injected, by kind (chaos policy).
    pub by_kind: Arc<Mutex<BTreeMap<String, u64>>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Debug)]
enum Policy {
    Listed(Vec<Fault>),
    /// Every request: a fault with this probability.
    Chaos(f64),
    /// SQS SendMessage requests whose body holds one of these byte strings.
    RefuseSqsBodies(Vec<Vec<u8>>),
    /// Every DynamoDB UpdateItem whose body holds this byte string (e.g. one table's name).
    FailUpdates(Vec<u8>),
    /// GetRecords answers: each REMOVE record whose sort key holds this text gets the
    /// `userIdentity` of DynamoDB's TTL service, as a TTL expiry's record has it.
    MarkTtlDeletes(String),
}

/// U+FFFF as UTF-8: a character SQS refuses in a message body.
pub const U_FFFF: &[u8] = &[0xEF, 0xBF, 0xBF];

/// What the proxy does to one request.
enum Action {
    Error(u16, String),
    /// An SQS error in SQS's JSON protocol (query-compatible code header included): status,
    /// code, message.
    SqsError(u16, &'static str, &'static str),
    /// Close the connection without forwarding.
    DropBefore,
    /// Forward, then close the connection instead of answering: the call took effect but
    /// the caller cannot know.
    DropAfter,
    Delay(u64),
}

/// A fault for a call, by its `X-Amz-Target`, as production can produce it.
fn chaos_action(target: &str) -> (String, Action) {
    let op = target.rsplit('.').next().unwrap_or("");
    let (service, throttle) = if target.starts_with("DynamoDBStreams") {
        ("streams", "LimitExceededException")
    } else if target.starts_with("AmazonSQS") {
        ("sqs", "")
    } else {
        ("dynamodb", "ProvisionedThroughputExceededException")
    };
    let mut kinds: Vec<&str> = vec!["500", "drop-before", "delay"];
    if !op.starts_with("Get") && !op.starts_with("Describe") && !op.starts_with("Scan") && !op.starts_with("Query") {
        kinds.push("drop-after");
    }
    if !throttle.is_empty() {
        kinds.push("throttle");
    }
    if op == "GetRecords" {
        kinds.push("expired-iterator");
    }
    let kind = kinds[fastrand::usize(..kinds.len())];
    let action = match kind {
        "500" => Action::Error(500, "InternalServerError".into()),
        "throttle" => Action::Error(400, throttle.into()),
        "expired-iterator" => Action::Error(400, "ExpiredIteratorException".into()),
        "drop-before" => Action::DropBefore,
        "drop-after" => Action::DropAfter,
        _ => Action::Delay(fastrand::u64(100..1500)),
    };
    (format!("{service} {kind}"), action)
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
    launch(upstream_port, Policy::Listed(faults), max_faults).await
}

/// Every call through the proxy meets a fault with probability `rate`.
pub async fn start_chaos(upstream_port: u16, rate: f64, max_faults: u64) -> FaultProxy {
    launch(upstream_port, Policy::Chaos(rate), max_faults).await
}

/// In front of the SQS server: a SendMessage whose request body holds any of `needles` (raw
/// bytes, e.g. [`U_FFFF`]) is answered as SQS answers a body with characters outside its set,
/// HTTP 400 `InvalidMessageContents`; everything else is forwarded.
pub async fn start_refusing_sqs_bodies(upstream_port: u16, needles: Vec<Vec<u8>>, max_faults: u64) -> FaultProxy {
    launch(upstream_port, Policy::RefuseSqsBodies(needles), max_faults).await
}

/// In front of DynamoDB Local: every UpdateItem on `table` is answered HTTP 500
/// InternalServerError (an aggregate table that refuses every write); all else is forwarded.
pub async fn start_failing_updates_to(upstream_port: u16, table: &str, max_faults: u64) -> FaultProxy {
    launch(upstream_port, Policy::FailUpdates(format!("\"TableName\":\"{table}\"").into_bytes()), max_faults).await
}

/// In front of DynamoDB Local's streams: REMOVE records whose sort key holds `needle` come out
/// of GetRecords as deletes by DynamoDB's TTL service (DynamoDB Local does not emulate TTL, so
/// it never writes that `userIdentity`); everything else is forwarded unchanged. `by_kind`
/// counts the records marked under "ttl_delete".
pub async fn start_marking_ttl_deletes(upstream_port: u16, needle: &str) -> FaultProxy {
    launch(upstream_port, Policy::MarkTtlDeletes(needle.to_string()), 0).await
}

/// `response` (a whole HTTP message) with the REMOVE records of its GetRecords body whose sort
/// key holds `needle` marked as TTL deletes, and how many it marked. Unchanged when none is (or
/// the body is not JSON). The CRC32 header goes: the body it covered is gone.
fn mark_ttl_deletes(response: Vec<u8>, needle: &str) -> (Vec<u8>, u64) {
    let Some(end) = response.windows(4).position(|w| w == b"\r\n\r\n") else { return (response, 0) };
    let head = String::from_utf8_lossy(&response[..end]).to_string();
    let raw = &response[end + 4..];
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(raw) } else { raw.to_vec() };
    let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(&body) else { return (response, 0) };
    let mut marked = 0;
    for r in json.get_mut("Records").and_then(|r| r.as_array_mut()).into_iter().flatten() {
        let sk = r["dynamodb"]["Keys"]["SK"]["S"].as_str().unwrap_or("");
        if r["eventName"] == "REMOVE" && sk.contains(needle) {
            // The API's shape (`Identity`: PrincipalId, Type), not the Lambda event's.
            r["userIdentity"] = serde_json::json!({"Type": "Service", "PrincipalId": "dynamodb.amazonaws.com"});
            marked += 1;
        }
    }
    if marked == 0 {
        return (response, 0);
    }
    let body = serde_json::to_vec(&json).unwrap();
    let kept: Vec<&str> = head
        .split("\r\n")
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            !l.starts_with("content-length:") && !l.starts_with("transfer-encoding:") && !l.starts_with("x-amz-crc32:")
        })
        .collect();
    let mut out = format!("{}\r\nContent-Length: {}\r\n\r\n", kept.join("\r\n"), body.len()).into_bytes();
    out.extend_from_slice(&body);
    (out, marked)
}

/// The payload of a complete chunked body.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    // Bounded by the body: each pass consumes at least a size line.
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&body[..line_end]).to_string();
        let Ok(size) = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16) else { break };
        if size == 0 || body.len() < line_end + 2 + size {
            break;
        }
        out.extend_from_slice(&body[line_end + 2..line_end + 2 + size]);
        body = &body[(line_end + 4 + size).min(body.len())..];
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

async fn launch(upstream_port: u16, policy: Policy, max_faults: u64) -> FaultProxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let injected = Arc::new(AtomicU64::new(0));
    let forwarded = Arc::new(AtomicU64::new(0));
    let by_kind = Arc::new(Mutex::new(BTreeMap::new()));
    let counters = Counters { injected: injected.clone(), forwarded: forwarded.clone(), by_kind: by_kind.clone(), max_faults };
    let policy = Arc::new(policy);
    let task = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else { continue };
            let (counters, policy) = (counters.clone(), policy.clone());
            tokio::spawn(async move {
                let _ = serve(client, upstream_port, &policy, &counters).await;
            });
        }
    });
    FaultProxy { port, injected, forwarded, by_kind, task }
}

#[derive(Clone)]
struct Counters {
    injected: Arc<AtomicU64>,
    forwarded: Arc<AtomicU64>,
    by_kind: Arc<Mutex<BTreeMap<String, u64>>>,
    max_faults: u64,
}

impl Counters {
    /// Takes one fault from the budget; false when it is spent.
    fn take(&self, kind: &str) -> bool {
        if self.injected.fetch_add(1, Ordering::SeqCst) >= self.max_faults {
            self.injected.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        *self.by_kind.lock().unwrap_or_else(|e| e.into_inner()).entry(kind.to_string()).or_default() += 1;
        true
    }
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

async fn serve(mut client: TcpStream, upstream_port: u16, policy: &Policy, counters: &Counters) -> std::io::Result<()> {
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
        let action = match policy {
            Policy::Listed(faults) => faults
                .iter()
                .find(|f| target.contains(f.target) && fastrand::f64() < f.rate)
                .map(|f| (f.error_type.to_string(), Action::Error(f.status, f.error_type.to_string()))),
            Policy::Chaos(rate) => (fastrand::f64() < *rate).then(|| chaos_action(&target)),
            Policy::RefuseSqsBodies(needles) => {
                (target == "AmazonSQS.SendMessage" && needles.iter().any(|n| contains(&request, n))).then(|| {
                    let message = "Invalid binary character was found in the message body, the set of allowed characters is \
                     #x9 | #xA | #xD | #x20 to #xD7FF | #xE000 to #xFFFD | #x10000 to #x10FFFF";
                    ("sqs InvalidMessageContents".to_string(), Action::SqsError(400, "InvalidMessageContents", message))
                })
            }
            Policy::FailUpdates(needle) => (target.ends_with(".UpdateItem") && contains(&request, needle))
                .then(|| ("InternalServerError".to_string(), Action::Error(500, "InternalServerError".into()))),
            Policy::MarkTtlDeletes(_) => None,
        };
        let action = action.filter(|(kind, _)| counters.take(kind)).map(|(_, a)| a);
        match &action {
            Some(Action::Error(status, error_type)) => {
                let status = *status;
                let body =
                    format!(r#"{{"__type":"com.amazonaws.dynamodb.v20120810#{error_type}","message":"injected by the test proxy"}}"#);
                let reason = if status == 400 { "Bad Request" } else { "Internal Server Error" };
                let resp = format!(
                    "HTTP/1.1 {status} {reason}\r\nContent-Type: application/x-amz-json-1.0\r\nx-amzn-RequestId: proxy-{}\r\nx-amzn-ErrorType: {error_type}\r\nContent-Length: {}\r\n\r\n{body}",
                    fastrand::u64(..),
                    body.len()
                );
                client.write_all(resp.as_bytes()).await?;
                continue;
            }
            Some(Action::SqsError(status, code, message)) => {
                let body = serde_json::json!({ "__type": format!("com.amazonaws.sqs#{code}"), "message": message }).to_string();
                let resp = format!(
                    "HTTP/1.1 {status} Bad Request\r\nContent-Type: application/x-amz-json-1.0\r\nx-amzn-RequestId: proxy-{}\r\nX-Amzn-ErrorType: com.amazonaws.sqs#{code}\r\nx-amzn-query-error: {code};Sender\r\nContent-Length: {}\r\n\r\n{body}",
                    fastrand::u64(..),
                    body.len()
                );
                client.write_all(resp.as_bytes()).await?;
                continue;
            }
            Some(Action::DropBefore) => return Ok(()),
            Some(Action::Delay(ms)) => tokio::time::sleep(std::time::Duration::from_millis(*ms)).await,
            Some(Action::DropAfter) | None => {}
        }
        if upstream.is_none() {
            upstream = Some(TcpStream::connect(("127.0.0.1", upstream_port)).await?);
        }
        let Some(up) = upstream.as_mut() else { return Ok(()) };
        up.write_all(&request).await?;
        let Some((_, response)) = read_message(up, &mut ubuf).await? else { return Ok(()) };
        counters.forwarded.fetch_add(1, Ordering::SeqCst);
        if matches!(action, Some(Action::DropAfter)) {
            return Ok(());
        }
        let response = match policy {
            Policy::MarkTtlDeletes(needle) if target.ends_with(".GetRecords") => {
                let (response, marked) = mark_ttl_deletes(response, needle);
                *counters.by_kind.lock().unwrap_or_else(|e| e.into_inner()).entry("ttl_delete".to_string()).or_default() += marked;
                response
            }
            _ => response,
        };
        client.write_all(&response).await?;
    }
    Ok(())
}
