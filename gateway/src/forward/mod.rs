//! Forwarding over the mesh: the caller's side (a request for a session held by
//! another worker, and what a failure proves) and the owner's side (serving a
//! forwarded request on the local path).

pub mod caller;
pub mod owner;
