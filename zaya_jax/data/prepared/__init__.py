"""Prepared data: documents tokenized once into ArrayRecord shards with a manifest.

:mod:`.format` (file names, the record and manifest layout, constants) and :mod:`.reader` (the
manifest read and the shards verified, random access to the documents) are what training reads;
:mod:`.writer` (``zaya data prepare``) and :mod:`.work` (its work over hosts and worker processes,
resumable) write it. This package imports none of them, so importing the reader never loads the
writer. The public names are ``zaya_jax.data``'s ``prepare``, ``open_prepared`` and ``read_manifest``.
"""
