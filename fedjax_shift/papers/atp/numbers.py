"""The results that Bao, Wei, Wang and He, NeurIPS 2023 report, printed beside ours."""

# layout key -> {'source': where in the paper (table number, dataset, model),
#                'rows': {our row label: {our column label: the paper's value (%)}}}
# From Bao et al., NeurIPS 2023: Tables 1, 3 and 5 in our Table 1 / Table 3
# layouts. Left out: Table 2 (Digits-5 and PACS, hybrid shift, one column per target domain:
# no column of ours). Table 7 (FedAvg / FedProx / q-FFL global models, hybrid shift) has
# its own layout ('atp_table7').
# The paper has no EATA row. Values are the means of 'mean ± s.d.'; 'Avg. rank' as printed.
# Table 1's model and client counts are not in Bao et al., NeurIPS 2023; the authors' code gives the protocol.
PAPER_NUMBERS = {
    # CIFAR-10, model not named in Bao et al., NeurIPS 2023; 240 source + 60 target clients, batch 20 (the authors' code)
    'Table 1 (CIFAR-10)': {
        'source': 'Table 1, CIFAR-10, feature / label / hybrid shift, accuracy on target clients',
        'rows': {
            'No adaptation': {'Feature shift': 69.42, 'Label shift': 72.98, 'Hybrid shift': 63.68, 'Avg. rank': 7.7},
            'BN-Adapt': {'Feature shift': 73.52, 'Label shift': 54.54, 'Hybrid shift': 50.42, 'Avg. rank': 7.0},
            'SHOT': {'Feature shift': 71.76, 'Label shift': 48.13, 'Hybrid shift': 44.68, 'Avg. rank': 9.3},
            'Tent': {'Feature shift': 71.76, 'Label shift': 50.13, 'Hybrid shift': 46.05, 'Avg. rank': 8.3},
            'T3A': {'Feature shift': 69.53, 'Label shift': 71.70, 'Hybrid shift': 62.17, 'Avg. rank': 8.0},
            'MEMO': {'Feature shift': 72.43, 'Label shift': 77.30, 'Hybrid shift': 68.07, 'Avg. rank': 4.3},
            'EM': {'Feature shift': 65.18, 'Label shift': 80.73, 'Hybrid shift': 69.85, 'Avg. rank': 5.0},
            'BBSE': {'Feature shift': 63.98, 'Label shift': 79.30, 'Hybrid shift': 67.96, 'Avg. rank': 6.7},
            'Surgical': {'Feature shift': 69.85, 'Label shift': 76.00, 'Hybrid shift': 66.94, 'Avg. rank': 6.3},
            'ATP-batch': {'Feature shift': 73.68, 'Label shift': 79.90, 'Hybrid shift': 73.05, 'Avg. rank': 2.3},
            'ATP-online': {'Feature shift': 74.06, 'Label shift': 81.96, 'Hybrid shift': 75.37, 'Avg. rank': 1.0},
        },
    },
    # As Table 1; ATP-batch inferred: diagonal = Table 1 ATP-batch, first row = No adaptation
    'Table 3 (CIFAR-10, ATP-batch)': {
        'source': 'Table 3, train (row) vs test (column) shift of the adaptation rates; dataset and variant inferred from the values matching Table 1 (CIFAR-10, ATP-batch)',
        'rows': {
            'No adaptation': {'Feature shift': 69.42, 'Label shift': 72.98, 'Hybrid shift': 63.68},
            'Feature shift': {'Feature shift': 73.68, 'Label shift': 65.05, 'Hybrid shift': 60.64},
            'Label shift': {'Feature shift': 67.99, 'Label shift': 79.90, 'Hybrid shift': 69.50},
            'Hybrid shift': {'Feature shift': 72.69, 'Label shift': 78.92, 'Hybrid shift': 73.05},
        },
    },
    # Shallow CNN on CIFAR-10, same three shifts as Table 1 ("different model architectures")
    'Table 5 (Shallow CNN, CIFAR-10)': {
        'source': 'Table 5, Shallow CNN on CIFAR-10 (left half)',
        'rows': {
            'No adaptation': {'Feature shift': 64.39, 'Label shift': 69.33, 'Hybrid shift': 61.99, 'Avg. rank': 7.3},
            'BN-Adapt': {'Feature shift': 66.46, 'Label shift': 54.99, 'Hybrid shift': 50.40, 'Avg. rank': 7.0},
            'SHOT': {'Feature shift': 65.60, 'Label shift': 49.98, 'Hybrid shift': 45.95, 'Avg. rank': 9.0},
            'Tent': {'Feature shift': 65.61, 'Label shift': 50.12, 'Hybrid shift': 45.91, 'Avg. rank': 8.7},
            'T3A': {'Feature shift': 64.31, 'Label shift': 66.96, 'Hybrid shift': 59.65, 'Avg. rank': 8.3},
            'MEMO': {'Feature shift': 65.89, 'Label shift': 71.95, 'Hybrid shift': 64.17, 'Avg. rank': 5.3},
            'EM': {'Feature shift': 61.74, 'Label shift': 76.28, 'Hybrid shift': 67.54, 'Avg. rank': 5.0},
            'BBSE': {'Feature shift': 56.92, 'Label shift': 75.99, 'Hybrid shift': 66.64, 'Avg. rank': 6.3},
            'Surgical': {'Feature shift': 64.45, 'Label shift': 73.75, 'Hybrid shift': 65.67, 'Avg. rank': 5.7},
            'ATP-batch': {'Feature shift': 66.90, 'Label shift': 76.23, 'Hybrid shift': 68.88, 'Avg. rank': 2.3},
            'ATP-online': {'Feature shift': 67.13, 'Label shift': 78.56, 'Hybrid shift': 71.52, 'Avg. rank': 1.0},
        },
    },
    # ResNet-50 on CIFAR-100, same three shifts as Table 1 ("different model architectures")
    'Table 5 (ResNet-50, CIFAR-100)': {
        'source': 'Table 5, ResNet-50 on CIFAR-100 (right half)',
        'rows': {
            'No adaptation': {'Feature shift': 45.31, 'Label shift': 51.63, 'Hybrid shift': 40.01, 'Avg. rank': 7.3},
            'BN-Adapt': {'Feature shift': 47.75, 'Label shift': 34.85, 'Hybrid shift': 30.31, 'Avg. rank': 7.3},
            'SHOT': {'Feature shift': 45.42, 'Label shift': 31.06, 'Hybrid shift': 27.44, 'Avg. rank': 9.3},
            'Tent': {'Feature shift': 45.91, 'Label shift': 31.34, 'Hybrid shift': 27.93, 'Avg. rank': 8.3},
            'T3A': {'Feature shift': 45.31, 'Label shift': 51.42, 'Hybrid shift': 39.89, 'Avg. rank': 7.7},
            'MEMO': {'Feature shift': 48.42, 'Label shift': 55.19, 'Hybrid shift': 42.53, 'Avg. rank': 3.7},
            'EM': {'Feature shift': 43.00, 'Label shift': 59.34, 'Hybrid shift': 44.82, 'Avg. rank': 5.0},
            'BBSE': {'Feature shift': 37.26, 'Label shift': 56.97, 'Hybrid shift': 40.09, 'Avg. rank': 7.0},
            'Surgical': {'Feature shift': 45.18, 'Label shift': 54.83, 'Hybrid shift': 42.50, 'Avg. rank': 6.7},
            'ATP-batch': {'Feature shift': 48.35, 'Label shift': 58.06, 'Hybrid shift': 46.82, 'Avg. rank': 2.7},
            'ATP-online': {'Feature shift': 49.08, 'Label shift': 61.86, 'Hybrid shift': 49.51, 'Avg. rank': 1.0},
        },
    },
}
# Orderings the paper claims, checked on our numbers: (better row, worse row, columns);
# columns () = every column both rows have. Columns are named so that 'Avg. rank' (lower is
# better) is never compared. Each holds on the paper's own Tables 1 and 5 (and 3).
CLAIMS = (
    # ATP-online is the best row under every shift (Table 1; Table 5 both models).
    ('ATP-online', 'No adaptation', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'BN-Adapt', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'SHOT', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'Tent', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'T3A', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'MEMO', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'EM', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'BBSE', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'Surgical', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-online', 'ATP-batch', ('Feature shift', 'Label shift', 'Hybrid shift')),
    ('ATP-batch', 'No adaptation', ('Feature shift', 'Label shift', 'Hybrid shift')),
    # The trade-off the paper motivates ATP with (Fig. 2): BN-statistics methods help under
    # feature shift and hurt under label / hybrid shift; label-prior methods the reverse.
    ('BN-Adapt', 'No adaptation', ('Feature shift',)),
    ('No adaptation', 'BN-Adapt', ('Label shift', 'Hybrid shift')),
    ('No adaptation', 'Tent', ('Label shift', 'Hybrid shift')),
    ('No adaptation', 'SHOT', ('Label shift', 'Hybrid shift')),
    ('EM', 'No adaptation', ('Label shift',)),
    ('No adaptation', 'EM', ('Feature shift',)),
    # Table 3: α trained on the tested shift beats α trained on another (rows = train shift).
    ('Feature shift', 'Label shift', ('Feature shift',)),
    ('Feature shift', 'Hybrid shift', ('Feature shift',)),
    ('Label shift', 'Feature shift', ('Label shift',)),
    ('Label shift', 'Hybrid shift', ('Label shift',)),
    ('Hybrid shift', 'Feature shift', ('Hybrid shift',)),
    ('Hybrid shift', 'Label shift', ('Hybrid shift',)),
)

# Table 7: ATP on global models pretrained by FedAvg, FedProx (μ = 0.01) and q-FFL (q = 1),
# hybrid shift, CIFAR-10; columns named after the pretraining method.
TABLE7 = {
    'source': 'Table 7, hybrid shift on CIFAR-10, global model pretrained by FedAvg / FedProx '
              '(μ = 0.01) / q-FFL (q = 1)',
    'rows': {
        'No adaptation': {'FedAvg': 63.68, 'FedProx': 63.77, 'q-FFL': 63.87},
        'ATP-batch': {'FedAvg': 73.05, 'FedProx': 72.95, 'q-FFL': 73.15},
        'ATP-online': {'FedAvg': 75.37, 'FedProx': 75.51, 'q-FFL': 75.79},
    },
}
# "ATP enhances different global models": both ATP rows above No adaptation, online above
# batch, under every pretraining method.
TABLE7_CLAIMS = (
    ('ATP-online', 'ATP-batch', ('FedAvg', 'FedProx', 'q-FFL')),
    ('ATP-batch', 'No adaptation', ('FedAvg', 'FedProx', 'q-FFL')),
)
