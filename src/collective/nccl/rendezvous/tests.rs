//! Tests of the rendezvous and the environment parsing (no GPU, no process environment
//! touched): unit tests, as the module is private to the crate.

use crate::Error;
use std::collections::HashMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;

/// A localhost address with a port that was free a moment ago.
fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    let port = listener.local_addr().expect("local address").port();
    format!("127.0.0.1:{port}")
}

fn test_id() -> UniqueId {
    let mut id = [0u8; ID_BYTES];
    for (i, byte) in id.iter_mut().enumerate() {
        *byte = (i * 7 + 3) as u8;
    }
    id
}

fn setup_message(result: Result<UniqueId, Error>) -> String {
    match result {
        Err(Error::GroupSetup(message)) => message,
        other => panic!("expected a setup error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Rendezvous (no GPU)
// ---------------------------------------------------------------------------------------------

#[test]
fn rendezvous_hands_rank0_id_to_every_rank() {
    let addr = free_addr();
    let world = 4;
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..world)
                .map(|rank| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        if rank == 0 {
                            // Rank 0 starts last: the others must retry until it listens.
                            std::thread::sleep(Duration::from_millis(300));
                        }
                        super::share_id(rank, world, &addr, Duration::from_secs(20), || {
                            Ok(test_id())
                        })
                    })
                })
                .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread").expect("rendezvous"))
            .collect()
    });
    for id in ids {
        assert_eq!(id, test_id());
    }
}

#[test]
fn rendezvous_with_a_missing_rank_fails_within_the_timeout() {
    let addr = free_addr();
    let timeout = Duration::from_millis(1500);
    let started = Instant::now();
    let (rank0, rank1) = std::thread::scope(|s| {
        let a = addr.clone();
        let rank0 = s.spawn(move || super::share_id(0, 3, &a, timeout, || Ok(test_id())));
        let b = addr.clone();
        // Rank 1 waits longer than rank 0, so it hears rank 0's verdict.
        let rank1 = s.spawn(move || super::share_id(1, 3, &b, timeout * 4, || unreachable!()));
        (rank0.join().unwrap(), rank1.join().unwrap())
    });
    let elapsed = started.elapsed();
    assert!(
        elapsed < timeout + Duration::from_secs(3),
        "took {elapsed:?}"
    );
    let rank0 = setup_message(rank0);
    assert!(
        rank0.contains("never connected") && rank0.contains("[2]"),
        "{rank0}"
    );
    let rank1 = setup_message(rank1);
    assert!(
        rank1.contains("never connected") && rank1.contains("[2]"),
        "{rank1}"
    );
}

#[test]
fn rendezvous_without_rank0_fails_within_the_timeout() {
    let addr = free_addr();
    let timeout = Duration::from_millis(1000);
    let started = Instant::now();
    let message = setup_message(super::join(&addr, 1, 2, timeout));
    let elapsed = started.elapsed();
    assert!(
        elapsed >= timeout && elapsed < timeout + Duration::from_secs(3),
        "took {elapsed:?}"
    );
    assert!(message.contains("could not reach rank 0"), "{message}");
}

#[test]
fn rendezvous_refuses_ranks_that_disagree_on_the_world_size() {
    let addr = free_addr();
    let timeout = Duration::from_secs(10);
    let (rank0, rank1) = std::thread::scope(|s| {
        let a = addr.clone();
        let rank0 = s.spawn(move || super::share_id(0, 2, &a, timeout, || Ok(test_id())));
        let b = addr.clone();
        let rank1 = s.spawn(move || super::join(&b, 1, 3, timeout));
        (rank0.join().unwrap(), rank1.join().unwrap())
    });
    let rank0 = setup_message(rank0);
    assert!(rank0.contains("WORLD_SIZE=3"), "{rank0}");
    let rank1 = setup_message(rank1);
    assert!(rank1.contains("WORLD_SIZE=3"), "{rank1}");
}

#[test]
fn rendezvous_ignores_connections_that_are_not_ranks() {
    let addr = free_addr();
    let timeout = Duration::from_secs(10);
    let (rank0, rank1) = std::thread::scope(|s| {
        let a = addr.clone();
        let rank0 = s.spawn(move || super::share_id(0, 2, &a, timeout, || Ok(test_id())));
        // A stray client that sends garbage and one that sends nothing and hangs up.
        let deadline = Instant::now() + timeout;
        let stray = loop {
            match TcpStream::connect(&addr) {
                Ok(stream) => break stream,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("rank 0 never listened: {e}"),
            }
        };
        (&stray).write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(TcpStream::connect(&addr).unwrap());
        let b = addr.clone();
        let rank1 = s.spawn(move || super::join(&b, 1, 2, timeout));
        (rank0.join().unwrap(), rank1.join().unwrap())
    });
    assert_eq!(rank0.expect("rank 0"), test_id());
    assert_eq!(rank1.expect("rank 1"), test_id());
}

// ---------------------------------------------------------------------------------------------
// Environment parsing (no GPU, no process environment touched)
// ---------------------------------------------------------------------------------------------

fn parse(vars: &[(&str, &str)]) -> Result<EnvConfig, Error> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    EnvConfig::from_lookup(|name| vars.get(name).cloned())
}

fn env_error(vars: &[(&str, &str)]) -> String {
    match parse(vars) {
        Err(Error::GroupSetup(message)) => message,
        other => panic!("expected a setup error for {vars:?}, got {other:?}"),
    }
}

const FULL: [(&str, &str); 5] = [
    ("RANK", "1"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_RANK", "1"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29500"),
];

fn without(name: &str) -> Vec<(&'static str, &'static str)> {
    FULL.iter().copied().filter(|(k, _)| *k != name).collect()
}

fn with(name: &'static str, value: &'static str) -> Vec<(&'static str, &'static str)> {
    FULL.iter()
        .copied()
        .map(|(k, v)| if k == name { (k, value) } else { (k, v) })
        .collect()
}

#[test]
fn env_parses_torchrun_variables() {
    assert_eq!(
        parse(&FULL).unwrap(),
        EnvConfig {
            rank: 1,
            world_size: 4,
            local_rank: 1,
            master: Some("node0:29500".into()),
        }
    );
    assert_eq!(
        parse(&with("MASTER_ADDR", "::1"))
            .unwrap()
            .master
            .as_deref(),
        Some("[::1]:29500")
    );
    // Under torchrun the id travels on another port than torchrun's store.
    let mut vars = FULL.to_vec();
    vars.push(("DISTFLASH_RENDEZVOUS_PORT", "29611"));
    assert_eq!(parse(&vars).unwrap().master.as_deref(), Some("node0:29611"));
    vars.pop();
    vars.push(("DISTFLASH_RENDEZVOUS_PORT", "x"));
    assert!(format!("{:?}", parse(&vars)).contains("DISTFLASH_RENDEZVOUS_PORT"));
    // A group of one needs no rendezvous address.
    assert_eq!(
        parse(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]).unwrap(),
        EnvConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master: None,
        }
    );
}

#[test]
fn env_errors_name_the_variable() {
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        let message = env_error(&without(name));
        assert!(
            message.contains(name) && message.contains("not set"),
            "{name}: {message}"
        );
    }
    let message = env_error(&with("RANK", "one"));
    assert!(
        message.contains("RANK=\"one\"") && message.contains("0..4"),
        "{message}"
    );
    let message = env_error(&with("RANK", "4"));
    assert!(
        message.contains("RANK=4") && message.contains("out of range"),
        "{message}"
    );
    let message = env_error(&with("WORLD_SIZE", "0"));
    assert!(message.contains("WORLD_SIZE=0"), "{message}");
    let message = env_error(&with("LOCAL_RANK", "-1"));
    assert!(message.contains("LOCAL_RANK=\"-1\""), "{message}");
    let message = env_error(&with("MASTER_PORT", "70000"));
    assert!(
        message.contains("MASTER_PORT=\"70000\"") && message.contains("1..=65535"),
        "{message}"
    );
    let message = env_error(&with("MASTER_ADDR", " "));
    assert!(message.contains("MASTER_ADDR is empty"), "{message}");
}
