"""The variables collection in which a FedTHE personalised model carries what its
test-time step needs (Jiang & Lin, "Test-Time Robust Personalization for Federated
Learning", ICLR 2023): {'global_head': the global model's head, 'local_feature': the
client's mean training feature}. Written by algorithms/fedthe.py, read by
adapters/fedthe.py.
"""
EXTRA = 'fedthe'
