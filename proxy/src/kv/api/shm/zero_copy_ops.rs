//! The shared-memory ops of views and reservations (hello, segments, view, release view,
//! reserve, commit, abort): each frame's fields read and its answer written; what they do
//! is [`crate::kv::api::zero_copy`]'s.

use super::*;

impl Conn<'_> {
    fn engines(&self) -> Result<&Arc<crate::kv::api::zero_copy::Engines>, Fail> {
        self.limits.engines.as_ref().ok_or_else(|| {
            Fail(
                MG_ERR_NOT_LOCAL,
                "views and reservations are off (kv.zero_copy = false)".into(),
            )
        })
    }

    /// This connection's engine, made on first use when no `OP_HELLO` named one.
    fn engine(&mut self) -> Result<Arc<crate::kv::api::zero_copy::Engine>, Fail> {
        let engines = self.engines()?.clone();
        Ok(self.engine.get_or_insert_with(|| engines.engine()).clone())
    }

    pub(super) fn hello(&mut self, token: u64) -> Result<Vec<u8>, Fail> {
        let engines = self.engines()?.clone();
        // Before it, the connection was its own engine: taken over if it holds nothing.
        let holds = self.engine.as_ref().is_some_and(|e| e.held() != (0, 0));
        if self.said_hello || holds {
            return Err(Fail::arg(
                "hello comes once, before this connection holds leases or reservations",
            ));
        }
        self.said_hello = true;
        self.engine = Some(engines.join(self.peer_pid, token));
        Ok(engines.instance().to_le_bytes().to_vec())
    }

    /// The answer to `OP_SEGMENTS` and the descriptors to attach.
    pub(super) fn segments(&self) -> Result<(Vec<u8>, Vec<RawFd>), Fail> {
        let engines = self.engines()?;
        let mems = engines.memories();
        let mut body = Vec::with_capacity(12 + mems.len() * 12);
        body.extend_from_slice(&engines.instance().to_le_bytes());
        body.extend_from_slice(&(mems.len() as u32).to_le_bytes());
        let mut fds = Vec::with_capacity(2 * mems.len());
        for (id, m) in mems {
            body.extend_from_slice(&id.to_le_bytes());
            body.extend_from_slice(&m.len.to_le_bytes());
            let (rw, ro) = m.fds();
            fds.push(rw);
            fds.push(ro);
        }
        Ok((body, fds))
    }

    pub(super) async fn view(&mut self, keys: &[&[u8]]) -> Result<Vec<u8>, Fail> {
        let keys = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<Bytes>, Fail>>()?;
        let engine = self.engine()?;
        let (lease, items) = self
            .engines()?
            .view(self.state, &engine, keys)
            .await
            .map_err(|e| Fail(e.0, e.1))?;
        let mut out = Vec::with_capacity(8 + items.len() * ITEM_BYTES);
        out.extend_from_slice(&lease.to_le_bytes());
        for it in items {
            out.extend_from_slice(&it.status.to_le_bytes());
            out.extend_from_slice(&it.memory.to_le_bytes());
            out.extend_from_slice(&it.off.to_le_bytes());
            out.extend_from_slice(&it.len.to_le_bytes());
        }
        Ok(out)
    }

    pub(super) fn release_view(&mut self, lease: u64) -> Result<Vec<u8>, Fail> {
        let engine = self.engine()?;
        self.engines()?
            .release_lease(&engine, lease)
            .map_err(|e| Fail(e.0, e.1))?;
        Ok(Vec::new())
    }

    pub(super) async fn reserve(&mut self, items: &[(&[u8], u64)]) -> Result<Vec<u8>, Fail> {
        let items = items
            .iter()
            .map(|&(k, len)| Ok((self.key(k)?, len)))
            .collect::<Result<Vec<(Bytes, u64)>, Fail>>()?;
        let engine = self.engine()?;
        let got = self
            .engines()?
            .reserve(self.state, &engine, items)
            .await
            .map_err(|e| Fail(e.0, e.1))?;
        let mut out = Vec::with_capacity(got.len() * ITEM_BYTES);
        for it in got {
            out.extend_from_slice(&it.status.to_le_bytes());
            out.extend_from_slice(&it.memory.to_le_bytes());
            out.extend_from_slice(&it.off.to_le_bytes());
            out.extend_from_slice(&it.ticket.to_le_bytes());
        }
        Ok(out)
    }

    pub(super) async fn end_tickets(
        &mut self,
        tickets: &[u64],
        commit: bool,
    ) -> Result<Vec<u8>, Fail> {
        let engine = self.engine()?;
        let engines = self.engines()?;
        let codes = if commit {
            engines.commit(self.state, &engine, tickets).await
        } else {
            engines.abort(self.state, &engine, tickets).await
        };
        Ok(codes.iter().flat_map(|c| c.to_le_bytes()).collect())
    }
}
