//! Gauges set seldom: once a sweep of expired helpers (every ten minutes), once a reconcile
//! of everything, once a successful reconcile. The exporter drops a gauge not updated within
//! its idle timeout (that is how the gauges of shards no longer read disappear), so these are
//! set again at every upkeep ([`super::serve`]) for as long as they are held.

use std::sync::{Mutex, MutexGuard, PoisonError};

type Labels = Vec<(&'static str, String)>;

/// The held gauges: name, labels, last value.
static HELD: Mutex<Vec<(&'static str, Labels, f64)>> = Mutex::new(Vec::new());

fn held() -> MutexGuard<'static, Vec<(&'static str, Labels, f64)>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sets the gauge `name{labels}` to `value` and keeps it set until [`release`].
pub fn set(name: &'static str, labels: Labels, value: f64) {
    emit(name, &labels, value);
    let mut held = held();
    match held.iter_mut().find(|(n, l, _)| *n == name && *l == labels) {
        Some(h) => h.2 = value,
        None => held.push((name, labels, value)),
    }
}

/// Stops setting every series of `name`: they disappear after the idle timeout.
pub fn release(name: &'static str) {
    held().retain(|(n, _, _)| *n != name);
}

/// Sets every held gauge again.
pub fn refresh() {
    for (name, labels, value) in held().iter() {
        emit(name, labels, *value);
    }
}

/// The value held for `name{labels}`, if any.
pub fn value(name: &str, labels: &[(&'static str, String)]) -> Option<f64> {
    held().iter().find(|(n, l, _)| *n == name && l.as_slice() == labels).map(|h| h.2)
}

fn emit(name: &'static str, labels: &[(&'static str, String)], value: f64) {
    let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, v.clone())).collect();
    metrics::gauge!(name, labels).set(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_gauge_keeps_its_last_value_per_label_set_until_released() {
        // Names of this test only: the registry is process-wide.
        const A: &str = "held_test_a";
        const B: &str = "held_test_b";
        let rule = |r: &str| vec![("rule", r.to_string())];
        set(A, rule("x"), 1.0);
        set(A, rule("y"), 2.0);
        set(A, rule("x"), 3.0);
        set(B, vec![], 4.0);
        assert_eq!(value(A, &rule("x")), Some(3.0), "the later value replaces the earlier");
        assert_eq!(value(A, &rule("y")), Some(2.0), "another label set is its own gauge");
        refresh();
        release(A);
        assert_eq!((value(A, &rule("x")), value(A, &rule("y"))), (None, None), "released: every label set");
        assert_eq!(value(B, &[]), Some(4.0), "other names stay");
        release(B);
    }
}
