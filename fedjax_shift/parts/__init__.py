"""Pieces that training methods (``algorithms/``) and test-time methods (``adapters/``)
share, below both: ATP's per-module rates, FedTTA's inner step, the supervised
contrastive loss and projection, the ODPFL-HN hypernetwork, FedTHE's extras, losses and
update arithmetic. An adapter never imports an algorithm file, nor an algorithm an
adapter file: what both need lives here.
"""
