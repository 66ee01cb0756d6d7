"""The block I/O layer of the block-wise path: checkpoint readers (:mod:`.readers`), the sharded writer
(:mod:`.writers`), the safetensors format (:mod:`.formats`), the model without weights they fill
(:mod:`.skeleton`), the fingerprint of a run (:mod:`.fingerprints`), the memory probe (:mod:`.memory`) and the
model sources (:mod:`.sources`: the default model, a user's model reference, its tokenizer)."""
