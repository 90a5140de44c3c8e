"""Selection-quality research: a GGUF teacher (:mod:`.teacher`), corpora, selection rules and
metrics (:mod:`.selection`), indexer fitting (:mod:`.fit`), recall and sparse-loss measurements."""
