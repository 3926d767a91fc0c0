//! An in-process transport: the ranks are threads of one process and messages are tensors
//! handed over channels, then copied into the receiver's own memory. Works on every Burn backend;
//! used by the CPU tests and by users without NCCL.
//!
//! # Ordering across threads
//!
//! Backends that queue work per host thread (CubeCL: one stream per thread, each with its own
//! memory pool) order a kernel after other streams' *earlier writes* to its inputs, but not a
//! stream's *reuse of freed memory* after other streams' pending reads: a buffer returns to its
//! owner's pool as soon as its last handle drops, on whichever thread, and the owner's next
//! allocation may overwrite it before another stream's queued kernels have read it (on wgpu the
//! owner's stream can reach the device queue first). So the transport never lets a receiver
//! compute on the sender's memory:
//!
//! 1. The sender host-synchronises its stream before handing tensors over (their writes are
//!    done).
//! 2. On [`Exchange::wait`] the receiver copies each received tensor into memory of its own
//!    stream; kernels launched later read only the copy, which its own stream orders.
//! 3. The receiver keeps the sender's tensors alive until its next host synchronisation (at its
//!    next exchange, or when the transport is dropped), when the copies have certainly run.
//!
//! The caller may therefore drop sent and received tensors whenever it likes, as with NCCL.

use crate::Error;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::{
    DeviceGroup, Exchange, Incoming, MessageKind, Outgoing, Received, TensorLayout, Transport,
};

/// How long a rank waits for a peer before failing with [`Error::Timeout`], unless told
/// otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// What travels between two threads.
enum Payload<B: Backend> {
    Tensors(MessageKind, Vec<FloatTensor<B>>),
    Values(Vec<u64>),
}

/// A payload stamped with the sender's exchange number, so out-of-step peers are detected.
struct Packet<B: Backend> {
    sequence: u64,
    payload: Payload<B>,
}

impl<B: Backend> Packet<B> {
    fn describe(&self) -> String {
        match &self.payload {
            Payload::Tensors(kind, _) => format!("{kind:?} of exchange {}", self.sequence),
            Payload::Values(_) => format!("values of all-gather {}", self.sequence),
        }
    }
}

/// The receiving end of one peer's channel, with packets that arrived early set aside.
struct Inbox<B: Backend> {
    receiver: Receiver<Packet<B>>,
    early: VecDeque<Packet<B>>,
}

/// Per-peer slots of one rank (`None` for the rank itself).
type PeerSlots<T> = Vec<Option<Mutex<T>>>;

/// One rank of an in-process group. Build all ranks at once with [`LocalTransport::group`] or
/// [`DeviceGroup::in_process`].
pub struct LocalTransport<B: Backend> {
    rank: usize,
    device: B::Device,
    timeout: Duration,
    /// Sender to each peer (`None` for this rank itself).
    outboxes: PeerSlots<Sender<Packet<B>>>,
    /// Receiver from each peer (`None` for this rank itself).
    inboxes: PeerSlots<Inbox<B>>,
    exchanges: AtomicU64,
    gathers: AtomicU64,
    /// The senders' tensors of messages received since this rank's last host synchronisation:
    /// this rank's queued copies read them, so their memory must not return to the senders'
    /// pools before that synchronisation.
    held: Mutex<Vec<FloatTensor<B>>>,
    /// The first failure while messages were moving; from then on every call fails with
    /// [`Error::Broken`] rather than pair messages of different steps.
    failure: Mutex<Option<String>>,
}

impl<B: Backend> LocalTransport<B> {
    /// One transport per device (rank `i` computes on `devices[i]`), fully connected.
    pub fn group(devices: Vec<B::Device>, timeout: Duration) -> Vec<Self> {
        let n = devices.len();
        let mut outboxes: Vec<PeerSlots<Sender<Packet<B>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut inboxes: Vec<PeerSlots<Inbox<B>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for src in 0..n {
            for dst in (0..n).filter(|&dst| dst != src) {
                let (sender, receiver) = channel();
                outboxes[src][dst] = Some(Mutex::new(sender));
                inboxes[dst][src] = Some(Mutex::new(Inbox {
                    receiver,
                    early: VecDeque::new(),
                }));
            }
        }
        devices
            .into_iter()
            .zip(outboxes.into_iter().zip(inboxes))
            .enumerate()
            .map(|(rank, (device, (outboxes, inboxes)))| Self {
                rank,
                device,
                timeout,
                outboxes,
                inboxes,
                exchanges: AtomicU64::new(0),
                gathers: AtomicU64::new(0),
                held: Mutex::new(Vec::new()),
                failure: Mutex::new(None),
            })
            .collect()
    }

    /// Fails with [`Error::Broken`] once a call has failed while messages were moving.
    fn check_usable(&self) -> Result<(), Error> {
        match &*self.failure.lock().expect("failure poisoned") {
            Some(cause) => Err(Error::Broken {
                rank: self.rank,
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records `error` as the failure that broke the group (the first one is kept).
    fn broken(&self, error: Error) -> Error {
        (self.failure.lock().expect("failure poisoned")).get_or_insert_with(|| error.to_string());
        error
    }

    /// Refuses a peer outside the group or this rank itself.
    fn check_peer(&self, peer: usize) -> Result<(), Error> {
        self.peer_slot(&self.outboxes, peer).map(|_| ())
    }

    /// Host-synchronises this rank's stream (every kernel queued so far has run), then lets go
    /// of the senders' tensors that the queued copies were reading.
    fn settle(&self) -> Result<(), Error> {
        let mut held = self.held.lock().expect("held tensors poisoned");
        B::sync(&self.device).map_err(|e| {
            self.broken(Error::GroupSetup(format!(
                "rank {}: the device failed during an exchange: {e:?}",
                self.rank
            )))
        })?;
        held.clear();
        Ok(())
    }

    /// [`settle`](Self::settle), only when senders' tensors are held.
    fn release_held(&self) -> Result<(), Error> {
        let pending = !self.held.lock().expect("held tensors poisoned").is_empty();
        if pending {
            self.settle()?;
        }
        Ok(())
    }

    /// A received tensor as this rank's own: a copy in memory of this rank's stream on its
    /// device. The sender's tensor is held until this rank's next synchronisation, since the
    /// copy is only queued.
    fn adopt(&self, sent: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        let source = B::float_device(&sent);
        // Held before copying: a tensor held twice is never updated in place, so the copy below
        // gets a buffer of its own.
        (self.held.lock().expect("held tensors poisoned")).push(sent.clone());
        if source != self.device {
            // A transfer between devices allocates on the destination; its read of the source
            // runs on this thread's stream of the source device, which is synchronised here.
            let moved = B::float_to_device(sent, &self.device);
            B::sync(&source).map_err(|e| {
                self.broken(Error::GroupSetup(format!(
                    "rank {}: the sender's device failed during a transfer: {e:?}",
                    self.rank
                )))
            })?;
            return Ok(moved);
        }
        // Multiplying by one is an exact copy for every float (signed zeros, infinities and NaN
        // included) and the one that every backend implements.
        Ok(B::float_mul_scalar(sent, 1.0f32.into()))
    }

    fn send(&self, peer: usize, packet: Packet<B>) -> Result<(), Error> {
        let outbox = self.peer_slot(&self.outboxes, peer)?;
        outbox
            .lock()
            .expect("outbox poisoned")
            .send(packet)
            .map_err(|_| {
                self.broken(Error::Disconnected {
                    rank: self.rank,
                    peer,
                })
            })
    }

    fn peer_slot<'a, T>(&self, slots: &'a [Option<T>], peer: usize) -> Result<&'a T, Error> {
        match slots.get(peer) {
            Some(Some(slot)) => Ok(slot),
            Some(None) => Err(Error::Mismatch {
                rank: self.rank,
                peer,
                detail: "a rank cannot send to or receive from itself".into(),
            }),
            None => Err(Error::GroupSetup(format!(
                "rank {} addressed rank {peer}, but the group has {} ranks",
                self.rank,
                slots.len()
            ))),
        }
    }

    /// Waits for the packet from `peer` with this sequence number that `matches`, setting aside
    /// packets of later exchanges that arrive first.
    fn take(
        &self,
        peer: usize,
        sequence: u64,
        kind: MessageKind,
        matches: impl Fn(&Payload<B>) -> bool,
        deadline: Instant,
    ) -> Result<Packet<B>, Error> {
        let mut inbox = self
            .peer_slot(&self.inboxes, peer)?
            .lock()
            .expect("inbox poisoned");
        let wanted = |p: &Packet<B>| p.sequence == sequence && matches(&p.payload);
        if let Some(i) = inbox.early.iter().position(wanted) {
            return Ok(inbox.early.remove(i).expect("index from position"));
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match inbox.receiver.recv_timeout(left) {
                Ok(packet) if wanted(&packet) => return Ok(packet),
                Ok(packet) if packet.sequence >= sequence => inbox.early.push_back(packet),
                Ok(packet) => {
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        peer,
                        detail: format!(
                            "expected {kind:?} of exchange {sequence}, got {}",
                            packet.describe()
                        ),
                    })
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout {
                        rank: self.rank,
                        peer,
                        kind,
                        waited: self.timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Disconnected {
                        rank: self.rank,
                        peer,
                    })
                }
            }
        }
    }
}

impl<B: Backend> DeviceGroup<B> {
    /// An in-process group over `devices` (rank `i` computes on `devices[i]`; devices may
    /// repeat), for one thread per rank. Any Burn backend.
    pub fn in_process(devices: Vec<B::Device>) -> Vec<Self> {
        Self::in_process_with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// [`DeviceGroup::in_process`] with a different wait limit for silent peers.
    pub fn in_process_with_timeout(devices: Vec<B::Device>, timeout: Duration) -> Vec<Self> {
        LocalTransport::<B>::group(devices, timeout)
            .into_iter()
            .map(DeviceGroup::new)
            .collect()
    }
}

/// A posted in-process exchange: sends are already delivered, receives are taken on wait.
struct LocalExchange<'a, B: Backend> {
    transport: &'a LocalTransport<B>,
    sequence: u64,
    receives: Vec<Incoming>,
    deadline: Instant,
}

impl<B: Backend> Transport<B> for LocalTransport<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.outboxes.len()
    }

    fn device(&self) -> &B::Device {
        &self.device
    }

    fn exchange(
        &self,
        sends: Vec<Outgoing<B>>,
        receives: Vec<Incoming>,
    ) -> Result<Box<dyn Exchange<B> + '_>, Error> {
        self.check_usable()?;
        // Bad peers are refused before anything moves (the group stays usable).
        for peer in (sends.iter().map(|m| m.peer)).chain(receives.iter().map(|m| m.peer)) {
            self.check_peer(peer)?;
        }
        let sequence = self.exchanges.fetch_add(1, Ordering::SeqCst);
        if !sends.is_empty() {
            // Every kernel that wrote a sent tensor has run before another thread reads it.
            self.settle()?;
        } else {
            self.release_held()?;
        }
        for message in sends {
            let packet = Packet {
                sequence,
                payload: Payload::Tensors(message.kind, message.tensors),
            };
            self.send(message.peer, packet)?;
        }
        Ok(Box::new(LocalExchange {
            transport: self,
            sequence,
            receives,
            deadline: Instant::now() + self.timeout,
        }))
    }

    fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error> {
        self.check_usable()?;
        let sequence = self.gathers.fetch_add(1, Ordering::SeqCst);
        let world = self.world_size();
        for peer in (0..world).filter(|&p| p != self.rank) {
            let packet = Packet {
                sequence,
                payload: Payload::Values(values.to_vec()),
            };
            self.send(peer, packet)?;
        }
        let deadline = Instant::now() + self.timeout;
        let gathered = (0..world)
            .map(|peer| {
                if peer == self.rank {
                    return Ok(values.to_vec());
                }
                let packet = self
                    .take(
                        peer,
                        sequence,
                        MessageKind::Values,
                        |p| matches!(p, Payload::Values(_)),
                        deadline,
                    )
                    .map_err(|e| self.broken(e))?;
                match packet.payload {
                    Payload::Values(v) => Ok(v),
                    Payload::Tensors(..) => unreachable!("matched on values"),
                }
            })
            .collect::<Result<Vec<_>, Error>>()?;
        // Checked once every peer's values are in, so the ranks stay in step.
        if let Some((peer, theirs)) = gathered
            .iter()
            .enumerate()
            .find(|(_, v)| v.len() != values.len())
        {
            return Err(Error::Mismatch {
                rank: self.rank,
                peer,
                detail: format!(
                    "all_gather_values: rank {peer} gave {} values, this rank {}",
                    theirs.len(),
                    values.len()
                ),
            });
        }
        Ok(gathered)
    }
}

impl<B: Backend> Exchange<B> for LocalExchange<'_, B> {
    /// A failure (silent peer, out-of-step or mismatched message) breaks the group.
    fn wait(self: Box<Self>) -> Result<Vec<Received<B>>, Error> {
        let transport = self.transport;
        self.receive().map_err(|e| transport.broken(e))
    }
}

impl<B: Backend> LocalExchange<'_, B> {
    fn receive(&self) -> Result<Vec<Received<B>>, Error> {
        let transport = self.transport;
        self.receives
            .iter()
            .map(|incoming| {
                let kind = incoming.kind;
                let packet = transport.take(
                    incoming.peer,
                    self.sequence,
                    kind,
                    |p| matches!(p, Payload::Tensors(k, _) if *k == kind),
                    self.deadline,
                )?;
                let Payload::Tensors(_, tensors) = packet.payload else {
                    unreachable!("matched on tensors")
                };
                let layouts: Vec<TensorLayout> =
                    tensors.iter().map(TensorLayout::of::<B>).collect();
                if layouts != incoming.layouts {
                    return Err(Error::Mismatch {
                        rank: transport.rank,
                        peer: incoming.peer,
                        detail: format!(
                            "{kind:?} has layouts {layouts:?}, expected {:?}",
                            incoming.layouts
                        ),
                    });
                }
                let tensors = tensors
                    .into_iter()
                    .map(|t| transport.adopt(t))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Received {
                    peer: incoming.peer,
                    kind,
                    tensors,
                })
            })
            .collect()
    }
}

impl<B: Backend> Drop for LocalTransport<B> {
    /// Lets the copies of the last messages run before the senders' memory is released (ranks
    /// drop their group on their own thread, whose stream queued the copies).
    fn drop(&mut self) {
        let held = self.held.get_mut().unwrap_or_else(|p| p.into_inner());
        if !held.is_empty() {
            let _ = B::sync(&self.device);
            held.clear();
        }
    }
}
