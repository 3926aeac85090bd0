"""The training path: token cache, batches, LightningModule, callbacks, run folder."""
