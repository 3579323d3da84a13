//! The default policy: admits every put with its config unchanged, which is exactly
//! Mooncake's behaviour. It asks for the put hook only so that metrics show which
//! plugin version served each call. moongate embeds it and runs it when no other plugin
//! is configured.

use moongate_policy_sdk::*;

struct Default;

impl Policy for Default {
    fn new(_config: &[u8]) -> Result<(Self, Interest), String> {
        Ok((Default, Interest::PUT))
    }
}

export_policy!(Default);
