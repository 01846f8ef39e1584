//! Matching a record against compiled patterns does not allocate, so records that no rule
//! wants cost no memory traffic. Counted with a global allocator wrapper (this test binary only).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ddb_aggregator::pattern::{PatternOptions, PatternSet};
use serde_json::json;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn matching_does_not_allocate() {
    let patterns = json!([
        {"dynamodb": {"Keys": {"SK": {"S": [{"prefix": "ORDER#"}]}}}},
        {"eventName": ["REMOVE"], "userIdentity": {"principalId": ["dynamodb.amazonaws.com"]}},
        {"dynamodb": {"NewImage": {"total": {"N": [{"numeric": [">", 100, "<=", 1000]}]}, "status": {"S": [{"anything-but": {"equals-ignore-case": ["paid", "shipped"]}}]}}}},
        {"dynamodb": {"NewImage": {"email": {"S": [{"suffix": {"equals-ignore-case": "@EXAMPLE.com"}}, {"wildcard": "*@*.test"}]}, "ip": {"S": [{"cidr": "10.0.0.0/8"}]}}}},
        {"dynamodb.NewImage.tags.SS": [{"exists": true}], "$or": [{"eventName": ["INSERT"]}, {"dynamodb": {"OldImage": {"status": {"S": ["PENDING"]}}}}]}
    ]);
    let set = PatternSet::compile(&patterns, PatternOptions { numeric_strings: true }).unwrap();
    let records = [
        json!({"eventName": "MODIFY", "dynamodb": {"Keys": {"PK": {"S": "CUST#c1"}, "SK": {"S": "PROFILE"}},
            "NewImage": {"total": {"N": "5000.5"}, "status": {"S": "PAID"}, "email": {"S": "Ann@Example.org"}, "ip": {"S": "192.168.1.1"}, "tags": {"SS": ["a"]}},
            "OldImage": {"status": {"S": "SHIPPED"}}, "ApproximateCreationDateTime": 1764460800}}),
        json!({"eventName": "INSERT", "dynamodb": {"Keys": {"PK": {"S": "PRODUCT#p"}, "SK": {"S": "META"}}, "NewImage": {"total": {"S": "n/a"}}}}),
    ];
    // Warm up anything lazily initialised, then count.
    for r in &records {
        assert!(!set.matches(r), "these records match no pattern");
    }
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for _ in 0..100 {
        for r in &records {
            assert!(!std::hint::black_box(set.matches(r)));
        }
    }
    let after = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(after - before, 0, "allocations while matching 200 non-matching records");
}
