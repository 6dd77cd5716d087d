"""Averaging: how a group of peers agrees on the mean of their tensors.

Modules (filled in by the all-reduce and Moshpit issues):

- partitioning, codecs and reduction bookkeeping: pure code, no network
- the butterfly all-reduce over peer connections
- Moshpit matchmaking over the DHT and the ``Averager`` API
- state transfer to newcomers
"""
