"""The byte-level vocabulary: UTF-8 bytes as ids 0-255, then BOS 256 and EOS 257.

:class:`dsa.serve.tokenizer.ByteTokenizer` writes these ids and :mod:`dsa.model.presets` sizes its
random-weight models for them; they live here, without torch, because the model sits below the
tokenizer's package (``serve``) and may not import it."""

BYTE_BOS_ID, BYTE_EOS_ID = 256, 257
BYTE_VOCAB_SIZE = 258
