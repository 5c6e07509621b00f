//! The on-disk layer: what a chunk file holds (`format`), where it lives
//! (`layout`, reached from held directory descriptors: `dirfds`), how it is opened, written and published (`files`), and how the
//! in-memory index of what is on disk (`index`) is rebuilt from the tree
//! (`scan`), and which other processes write the roots (`writers`), and the
//! keys and ciphers of sealed chunks (`seal`). Knows nothing of operations, backends or staging.

pub mod dirfds;
pub mod files;
pub mod format;
pub mod index;
pub mod layout;
pub mod ledger;
pub mod roots;
pub mod scan;
pub mod seal;
pub mod segment;
pub mod writers;
