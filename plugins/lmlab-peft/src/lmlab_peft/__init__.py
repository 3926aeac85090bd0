"""Parameter-efficient fine-tuning for lmlab (entry points ``lora``, ``dora``, ``ia3``, ``loha``, ``lokr``,
``adalora``, ``adapter``, ``qlora``, ``none``)."""
