"""Engine side: offline API, engine loop, scheduler, KV block pool, requests, outputs."""
