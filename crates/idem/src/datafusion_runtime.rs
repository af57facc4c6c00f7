//! The DataFusion runtime of the front ends over DataFusion and Ballista (`idem sql`, the
//! cluster dedup): object stores built from URLs as idem's own inputs' are.

use std::sync::Arc;

use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use object_store::ObjectStore;
use url::Url;

use crate::error::Result;
use crate::storage::{StorageOptions, object_store_for};

/// DataFusion's registry, which also builds a store the first time a query names an
/// `s3://`, `gs://`, `az://` or `memory://` URL, configured like idem's own inputs.
#[derive(Debug)]
struct StorageRegistry {
    known: DefaultObjectStoreRegistry,
    options: StorageOptions,
}

impl ObjectStoreRegistry for StorageRegistry {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        self.known.register_store(url, store)
    }

    fn deregister_store(&self, url: &Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        self.known.deregister_store(url)
    }

    fn get_store(&self, url: &Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        self.known.get_store(url).or_else(|unknown| {
            let Ok(store) = object_store_for(url, &self.options) else {
                return Err(unknown);
            };
            self.known.register_store(url, Arc::clone(&store));
            Ok(store)
        })
    }
}

/// A runtime whose object stores are built from URLs as idem's inputs are (environment and
/// `storage`), with a spilling memory pool of `memory_limit` bytes when given.
///
/// # Errors
/// The runtime cannot be built.
pub(crate) fn storage_runtime(
    memory_limit: Option<u64>,
    storage: &StorageOptions,
) -> Result<Arc<RuntimeEnv>> {
    let mut runtime =
        RuntimeEnvBuilder::new().with_object_store_registry(Arc::new(StorageRegistry {
            known: DefaultObjectStoreRegistry::new(),
            options: storage.clone(),
        }));
    if let Some(limit) = memory_limit {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        runtime = runtime.with_memory_pool(Arc::new(FairSpillPool::new(limit)));
    }
    Ok(runtime.build_arc()?)
}
