//! A client's lifecycle calls: `MountSegment`, `ReMountSegment`, `UnmountSegment`,
//! `Ping`, `FetchTasks`. moongate only reads the client id from them (a connection
//! belongs to one client process; by-client experiment arms follow it).

use crate::codec::message::{
    FetchTasksArgs, MountSegmentArgs, ReMountSegmentArgs, UnmountSegmentArgs,
};
use crate::codec::types::Uuid;

#[derive(Debug, Clone, Copy)]
pub enum Client<'a> {
    Mount(&'a MountSegmentArgs),
    ReMount(&'a ReMountSegmentArgs),
    Unmount(&'a UnmountSegmentArgs),
    Ping(&'a Uuid),
    FetchTasks(&'a FetchTasksArgs),
}

impl Client<'_> {
    pub fn client_id(&self) -> Uuid {
        match self {
            Client::Mount(a) => a.client_id,
            Client::ReMount(a) => a.client_id,
            Client::Unmount(a) => a.client_id,
            Client::Ping(id) => **id,
            Client::FetchTasks(a) => a.client_id,
        }
    }
}
