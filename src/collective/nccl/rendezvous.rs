//! A small TCP rendezvous that hands rank 0's NCCL unique id to every other rank of a
//! multi-process group, and the torchrun-style environment that says where rank 0 listens.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT` and waits until all `WORLD_SIZE - 1` other ranks
//! have connected and said who they are; only then does it send every one of them the 128-byte
//! id (so that either every rank goes on to create its communicator, or every rank gets the same
//! error). The other ranks connect with retries (rank 0 may start later than they do). Every
//! blocking step is bounded by the timeout, and a failure names the ranks that did not show up.
//!
//! Wire format (all integers little-endian): a joining rank sends `b"DFRV"`, the protocol
//! version (u32), its rank (u32) and the world size (u32); rank 0 answers one status byte, then
//! either the id (status 0) or a message (status 1: a u32 length and UTF-8 text).

use crate::Error;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Size of an NCCL unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// The bytes of an NCCL unique id, as rank 0 created them.
pub type UniqueId = [u8; ID_BYTES];

const MAGIC: [u8; 4] = *b"DFRV";
const PROTOCOL: u32 = 1;
const HELLO_BYTES: usize = 16;
const STATUS_OK: u8 = 0;
const STATUS_REFUSED: u8 = 1;
/// Longest refusal message a joining rank accepts (anything longer is not this protocol).
const MAX_MESSAGE: u32 = 64 * 1024;

/// Environment variable that overrides `MASTER_PORT` for the NCCL id rendezvous (needed under
/// torchrun, whose own store listens on `MASTER_PORT`).
pub const RENDEZVOUS_PORT_VAR: &str = "DISTFLASH_RENDEZVOUS_PORT";

/// Where and as whom this process joins a group, as torchrun describes it in the environment:
/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    /// This process's rank (`RANK`), in `0..world_size`.
    pub rank: usize,
    /// Number of processes (`WORLD_SIZE`), at least 1.
    pub world_size: usize,
    /// CUDA device ordinal this process computes on (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Rank 0's rendezvous address, `MASTER_ADDR:MASTER_PORT` (IPv6 literals in brackets).
    /// `None` for a group of one process, which needs no rendezvous (the two variables are then
    /// not required).
    pub master: Option<String>,
}

impl EnvConfig {
    /// Reads the process environment. Missing or malformed variables give
    /// [`Error::GroupSetup`] naming the variable and what it may hold.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|name| {
            std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Reads the variables through `lookup` (name to value) instead of the process environment,
    /// so that the parsing can be tested without touching process-global state.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let get = |name: &str, what: &str| -> Result<String, Error> {
            match lookup(name) {
                Some(value) if !value.trim().is_empty() => Ok(value.trim().to_string()),
                Some(_) => Err(Error::GroupSetup(format!(
                    "environment variable {name} is empty; expected {what} (torchrun sets it)"
                ))),
                None => Err(Error::GroupSetup(format!(
                    "environment variable {name} is not set; expected {what} (torchrun sets it)"
                ))),
            }
        };
        let number = |name: &str, what: &str| -> Result<usize, Error> {
            let value = get(name, what)?;
            value.parse::<usize>().map_err(|_| {
                Error::GroupSetup(format!("{name}={value:?} is not valid; expected {what}"))
            })
        };

        let world_size = number("WORLD_SIZE", "the number of processes, a positive integer")?;
        if world_size == 0 {
            return Err(Error::GroupSetup(
                "WORLD_SIZE=0 is not valid; expected the number of processes, a positive integer"
                    .into(),
            ));
        }
        let rank_what = format!("this process's rank, an integer in 0..{world_size}");
        let rank = number("RANK", &rank_what)?;
        if rank >= world_size {
            return Err(Error::GroupSetup(format!(
                "RANK={rank} is out of range; expected {rank_what} (WORLD_SIZE={world_size})"
            )));
        }
        let local_rank = number(
            "LOCAL_RANK",
            "the CUDA device ordinal of this process, a non-negative integer",
        )?;
        if world_size == 1 {
            return Ok(Self {
                rank,
                world_size,
                local_rank,
                master: None,
            });
        }
        let host = get(
            "MASTER_ADDR",
            "the host name or IP address of the machine running rank 0",
        )?;
        let port_what = "the TCP port rank 0 listens on, an integer in 1..=65535";
        // Under torchrun, MASTER_PORT is taken by torchrun's own store: this variable names a
        // free port for the NCCL id instead.
        let port_var = if lookup(RENDEZVOUS_PORT_VAR).is_some() {
            RENDEZVOUS_PORT_VAR
        } else {
            "MASTER_PORT"
        };
        let port_text = get(port_var, port_what)?;
        let port = match port_text.parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => {
                return Err(Error::GroupSetup(format!(
                    "{port_var}={port_text:?} is not valid; expected {port_what}"
                )))
            }
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master: Some(join_host_port(&host, port)),
        })
    }
}

/// `host:port`, with an IPv6 literal put in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Hands out rank 0's id: rank 0 calls `make_id` and serves the result with [`serve`]; every
/// other rank fetches it with [`join`]. A group of one needs no network.
pub fn share_id(
    rank: usize,
    world_size: usize,
    addr: &str,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<UniqueId, Error>,
) -> Result<UniqueId, Error> {
    if world_size == 0 || rank >= world_size {
        return Err(Error::GroupSetup(format!(
            "rank {rank} is not in a group of {world_size} ranks (expected 0..{world_size})"
        )));
    }
    if rank == 0 {
        let id = make_id()?;
        serve(addr, world_size, &id, timeout)?;
        Ok(id)
    } else {
        join(addr, rank, world_size, timeout)
    }
}

fn resolve(addr: &str) -> std::io::Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(std::io::Error::new(
            ErrorKind::NotFound,
            "the name resolved to no address",
        ));
    }
    Ok(addrs)
}

fn listen(addr: &str) -> Result<TcpListener, Error> {
    let resolved = resolve(addr).map_err(|e| {
        Error::GroupSetup(format!(
            "rank 0 could not resolve the rendezvous address {addr:?}: {e} (MASTER_ADDR must \
             name this machine)"
        ))
    })?;
    let first = resolved[0];
    let listener = match TcpListener::bind(first) {
        Ok(listener) => Ok(listener),
        // The name resolves to an address this machine does not own directly (NAT, a load
        // balancer): listen on every interface at that port instead.
        Err(e) if e.kind() == ErrorKind::AddrNotAvailable => {
            let any = match first.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            TcpListener::bind(SocketAddr::new(any, first.port()))
        }
        Err(e) => Err(e),
    };
    listener.map_err(|e| {
        let hint = if e.kind() == ErrorKind::AddrInUse {
            " (the port is taken: under torchrun, MASTER_PORT belongs to torchrun's own store, so \
             set DISTFLASH_RENDEZVOUS_PORT to a free port)"
        } else {
            ""
        };
        Error::GroupSetup(format!(
            "rank 0 could not listen on {addr} ({first}): {e}{hint}"
        ))
    })
}

/// A joining rank's greeting, as rank 0 read it.
struct Hello {
    rank: usize,
    world_size: usize,
}

fn read_hello(stream: &mut TcpStream, deadline: Instant) -> Option<Hello> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A connection that is not a rank of this group (a port scanner, a stale process) must not
    // hold rank 0 up for long.
    let limit = left
        .min(Duration::from_secs(5))
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(limit)).ok()?;
    let mut hello = [0u8; HELLO_BYTES];
    stream.read_exact(&mut hello).ok()?;
    let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes"));
    if hello[..4] != MAGIC || word(4) != PROTOCOL {
        return None;
    }
    Some(Hello {
        rank: word(8) as usize,
        world_size: word(12) as usize,
    })
}

fn send_refusal(stream: &mut TcpStream, message: &str) {
    let mut reply = vec![STATUS_REFUSED];
    reply.extend_from_slice(&(message.len() as u32).to_le_bytes());
    reply.extend_from_slice(message.as_bytes());
    // Best effort: the peer may already be gone, and rank 0 reports the failure itself.
    let _ = stream.write_all(&reply);
}

/// Rank 0's side: listens on `addr`, waits (at most `timeout`) until ranks `1..world_size` have
/// all connected, then sends each of them `id`. On failure, every rank that did connect is told
/// why, and the error names the ranks that did not show up.
pub fn serve(addr: &str, world_size: usize, id: &UniqueId, timeout: Duration) -> Result<(), Error> {
    if world_size <= 1 {
        return Ok(());
    }
    let started = Instant::now();
    let deadline = started + timeout;
    let listener = listen(addr)?;
    listener.set_nonblocking(true).map_err(|e| {
        Error::GroupSetup(format!("rank 0 could not poll its rendezvous socket: {e}"))
    })?;
    let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
    let mut joined = 0;
    let refuse_all = |peers: &mut [Option<TcpStream>], message: &str| {
        for stream in peers.iter_mut().flatten() {
            send_refusal(stream, message);
        }
    };

    while joined < world_size - 1 {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..world_size).filter(|&r| peers[r].is_none()).collect();
            let message = format!(
                "rendezvous at {addr}: rank 0 waited {:.1} s, but rank(s) {missing:?} of a group \
                 of {world_size} never connected (not started, crashed, or pointed at another \
                 MASTER_ADDR/MASTER_PORT)",
                started.elapsed().as_secs_f64()
            );
            refuse_all(&mut peers, &message);
            return Err(Error::GroupSetup(message));
        }
        match listener.accept() {
            Ok((mut stream, from)) => {
                if stream.set_nonblocking(false).is_err() {
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let Some(hello) = read_hello(&mut stream, deadline) else {
                    // Not a rank of this group: ignore it.
                    continue;
                };
                let problem = if hello.world_size != world_size {
                    Some(format!(
                        "rank {} (from {from}) was started with WORLD_SIZE={}, rank 0 with \
                         WORLD_SIZE={world_size}",
                        hello.rank, hello.world_size
                    ))
                } else if hello.rank == 0 || hello.rank >= world_size {
                    Some(format!(
                        "a process at {from} joined as rank {}, which is not one of the ranks \
                         1..{world_size} that connect to rank 0",
                        hello.rank
                    ))
                } else if peers[hello.rank].is_some() {
                    Some(format!(
                        "two processes joined as rank {} (the second from {from}): check RANK",
                        hello.rank
                    ))
                } else {
                    None
                };
                if let Some(problem) = problem {
                    let message = format!("rendezvous at {addr} failed: {problem}");
                    send_refusal(&mut stream, &message);
                    refuse_all(&mut peers, &message);
                    return Err(Error::GroupSetup(message));
                }
                peers[hello.rank] = Some(stream);
                joined += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                let message = format!("rendezvous at {addr}: rank 0 could not accept: {e}");
                refuse_all(&mut peers, &message);
                return Err(Error::GroupSetup(message));
            }
        }
    }

    let mut reply = Vec::with_capacity(1 + ID_BYTES);
    reply.push(STATUS_OK);
    reply.extend_from_slice(id);
    for (rank, stream) in peers.iter_mut().enumerate() {
        let Some(stream) = stream else { continue };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let sent = stream
            .set_write_timeout(Some(left))
            .and_then(|_| stream.write_all(&reply))
            .and_then(|_| stream.flush());
        if let Err(e) = sent {
            return Err(Error::GroupSetup(format!(
                "rendezvous at {addr}: rank {rank} left before it got the NCCL id: {e}"
            )));
        }
    }
    Ok(())
}

/// Another rank's side: connects to rank 0 at `addr` (retrying until rank 0 listens), says who
/// it is, and returns the id rank 0 sends, all within `timeout`.
pub fn join(
    addr: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<UniqueId, Error> {
    let started = Instant::now();
    let deadline = started + timeout;
    let waited = || started.elapsed().as_secs_f64();

    let mut last_error = String::from("no attempt finished");
    let mut stream = 'connect: loop {
        match resolve(addr) {
            Ok(addrs) => {
                for target in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(2))) {
                        Ok(stream) => break 'connect stream,
                        Err(e) => last_error = format!("{target}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("could not resolve {addr:?}: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(Error::GroupSetup(format!(
                "rank {rank}: could not reach rank 0 at {addr} within {:.1} s (last error: \
                 {last_error}); is rank 0 running, and do MASTER_ADDR/MASTER_PORT point at it?",
                waited()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = stream.set_nodelay(true);

    let io_error = |e: std::io::Error, doing: &str| {
        let timed_out = matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
        if timed_out {
            Error::GroupSetup(format!(
                "rank {rank}: connected to rank 0 at {addr}, but got no NCCL id within {:.1} s \
                 (rank 0 is still waiting for other ranks, or the process listening there is \
                 not rank 0 of this group)",
                waited()
            ))
        } else {
            Error::GroupSetup(format!(
                "rank {rank}: rendezvous with rank 0 at {addr} failed while {doing}: {e} (rank 0 \
                 stopped, or the process listening there is not rank 0 of this group)"
            ))
        }
    };
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };

    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&PROTOCOL.to_le_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world_size as u32).to_le_bytes());
    stream
        .set_write_timeout(Some(left()))
        .and_then(|_| stream.write_all(&hello))
        .and_then(|_| stream.flush())
        .map_err(|e| io_error(e, "sending its rank"))?;

    let mut status = [0u8; 1];
    stream
        .set_read_timeout(Some(left()))
        .and_then(|_| stream.read_exact(&mut status))
        .map_err(|e| io_error(e, "waiting for the NCCL id"))?;
    match status[0] {
        STATUS_OK => {
            let mut id = [0u8; ID_BYTES];
            stream
                .set_read_timeout(Some(left()))
                .and_then(|_| stream.read_exact(&mut id))
                .map_err(|e| io_error(e, "reading the NCCL id"))?;
            Ok(id)
        }
        STATUS_REFUSED => {
            let mut length = [0u8; 4];
            stream
                .set_read_timeout(Some(left()))
                .and_then(|_| stream.read_exact(&mut length))
                .map_err(|e| io_error(e, "reading rank 0's refusal"))?;
            let length = u32::from_le_bytes(length).min(MAX_MESSAGE) as usize;
            let mut message = vec![0u8; length];
            stream
                .read_exact(&mut message)
                .map_err(|e| io_error(e, "reading rank 0's refusal"))?;
            Err(Error::GroupSetup(format!(
                "rank {rank}: rank 0 called the rendezvous off: {}",
                String::from_utf8_lossy(&message)
            )))
        }
        other => Err(Error::GroupSetup(format!(
            "rank {rank}: the process at {addr} answered with status {other}, which is not this \
             rendezvous protocol (is MASTER_PORT taken by another program?)"
        ))),
    }
}

#[cfg(test)]
mod tests;
