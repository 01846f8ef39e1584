//! The registry item in DynamoDB: read it, decide ([`super::decide`]), register.
//!
//! Every registration bumps the item's `version`, conditioned on the version it read, so a
//! decision is made on the registry as it is when the write lands: of two deployments that
//! start at once, the later one decides again with the earlier one's entry. A start that finds
//! its own entry unchanged writes nothing (no stream record when the aggregates live in the
//! source table).

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;

use super::{decide, entry_attribute, registration, Decision, Entry, Refusal, Starting, ENTRY_PREFIX, KEY};
use crate::aws::{classify, Failure, FailureKind};

/// The item's version attribute: bumped by every registration.
const VERSION: &str = "version";
/// A line for whoever finds the item in the table.
const ABOUT: &str = "about";
const ABOUT_TEXT: &str = "ddb-aggregator: the deployments (ledger namespaces) that write this table; read at every start, do not delete";
/// Attempts when other starts keep changing the registry in between.
const ATTEMPTS: u32 = 10;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// This deployment would count the stream again: the operator must choose a namespace.
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("reading the ledger registry item in {table}: {failure}")]
    Read { table: String, failure: Failure },
    #[error("the ledger registry item in {table} changed {attempts} times while registering; start again")]
    Contended { table: String, attempts: u32 },
    #[error("the ledger registry item in {table} has a malformed entry {attribute} (every entry needs namespace, source_table, state_table, stream_arn and registered_at)")]
    Malformed { table: String, attribute: String },
}

/// What a start found and did.
#[derive(Debug, Clone)]
pub enum Registered {
    /// Written now (first start of this deployment, or a move that kept the namespace).
    Written(Entry),
    /// The registry already said so.
    Unchanged,
    /// May start, but the registration did not land (the table refuses writes): the next
    /// start tries again. The start was decided on the registry as read.
    NotWritten(Failure),
}

pub struct Registry {
    client: Client,
    table: String,
    /// The aggregates table's key attributes, each holding [`KEY`].
    key: HashMap<String, AttributeValue>,
}

impl Registry {
    pub fn new(client: Client, aggregates_table: &str, key_names: &[String]) -> Registry {
        let key = key_names.iter().map(|k| (k.clone(), AttributeValue::S(KEY.to_string()))).collect();
        Registry { client, table: aggregates_table.to_string(), key }
    }

    /// The entries and the item's version (None: no item yet).
    pub async fn read(&self) -> Result<(Vec<Entry>, Option<u64>), RegistryError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .set_key(Some(self.key.clone()))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| RegistryError::Read { table: self.table.clone(), failure: classify(&e) })?;
        let Some(item) = out.item() else { return Ok((Vec::new(), None)) };
        let version = item.get(VERSION).and_then(|v| v.as_n().ok()).and_then(|n| n.parse().ok());
        let mut entries = Vec::new();
        for (name, value) in item.iter().filter(|(k, _)| k.starts_with(ENTRY_PREFIX)) {
            let entry = decode(value).ok_or_else(|| RegistryError::Malformed { table: self.table.clone(), attribute: name.clone() })?;
            entries.push(entry);
        }
        entries.sort_by(|a, b| (&a.namespace, &a.source_table).cmp(&(&b.namespace, &b.source_table)));
        Ok((entries, version))
    }

    /// Refuses `this` ([`super::decide`]) or registers it, on the registry as it is when the
    /// registration lands.
    pub async fn check_and_register(&self, this: &Starting<'_>) -> Result<Registered, RegistryError> {
        for _ in 0..ATTEMPTS {
            let (entries, version) = self.read().await?;
            if let Decision::Refuse(r) = decide(&entries, this) {
                return Err(r.into());
            }
            let Some(entry) = registration(&entries, this, crate::state::now_ms()) else { return Ok(Registered::Unchanged) };
            match self.write(&entry, version).await {
                Ok(true) => return Ok(Registered::Written(entry)),
                Ok(false) => {}
                Err(failure) => return Ok(Registered::NotWritten(failure)),
            }
        }
        Err(RegistryError::Contended { table: self.table.clone(), attempts: ATTEMPTS })
    }

    /// Sets one entry if the item is still at `version`; false when it is not.
    async fn write(&self, entry: &Entry, version: Option<u64>) -> Result<bool, Failure> {
        let req = self
            .client
            .update_item()
            .table_name(&self.table)
            .set_key(Some(self.key.clone()))
            .update_expression("SET #e = :e, #v = :next, #about = :about")
            .expression_attribute_names("#e", entry_attribute(&entry.namespace, &entry.source_table))
            .expression_attribute_names("#v", VERSION)
            .expression_attribute_names("#about", ABOUT)
            .expression_attribute_values(":e", encode(entry))
            .expression_attribute_values(":next", AttributeValue::N((version.unwrap_or(0) + 1).to_string()))
            .expression_attribute_values(":about", AttributeValue::S(ABOUT_TEXT.to_string()));
        let req = match version {
            Some(v) => req.condition_expression("#v = :read").expression_attribute_values(":read", AttributeValue::N(v.to_string())),
            None => req.condition_expression("attribute_not_exists(#v)"),
        };
        match req.send().await {
            Ok(_) => Ok(true),
            Err(e) => {
                let failure = classify(&e);
                match failure.kind {
                    FailureKind::ConditionFailed => Ok(false),
                    _ => Err(failure),
                }
            }
        }
    }
}

fn encode(e: &Entry) -> AttributeValue {
    let s = |v: &str| AttributeValue::S(v.to_string());
    AttributeValue::M(HashMap::from([
        ("namespace".to_string(), s(&e.namespace)),
        ("source_table".to_string(), s(&e.source_table)),
        ("state_table".to_string(), s(&e.state_table)),
        ("stream_arn".to_string(), s(&e.stream_arn)),
        ("registered_at".to_string(), AttributeValue::N(e.registered_ms.to_string())),
    ]))
}

fn decode(v: &AttributeValue) -> Option<Entry> {
    let m = v.as_m().ok()?;
    let s = |k: &str| m.get(k).and_then(|v| v.as_s().ok()).cloned();
    Some(Entry {
        namespace: s("namespace")?,
        source_table: s("source_table")?,
        state_table: s("state_table")?,
        stream_arn: s("stream_arn")?,
        registered_ms: m.get("registered_at").and_then(|v| v.as_n().ok()).and_then(|n| n.parse().ok())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_back() {
        let e = Entry {
            namespace: "aaaaaa".into(),
            source_table: "orders".into(),
            state_table: "state-1".into(),
            stream_arn: "arn:s".into(),
            registered_ms: 42,
        };
        assert_eq!(decode(&encode(&e)), Some(e));
        assert_eq!(decode(&AttributeValue::S("x".into())), None);
        assert_eq!(decode(&AttributeValue::M(HashMap::new())), None);
    }
}
