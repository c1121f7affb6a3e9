"""The results that Feng, Yu, Liu, Xu, Khan and Zuo, ICCV 2023 report, printed beside ours."""

# layout key -> {'source': where in the paper (table number, dataset, model),
#                'rows': {our row label: {our column label: the paper's value (%)}}}
# From Feng et al., ICCV 2023 (its venue is not in the text; ICCV 2023 is where it appeared).
# Every method: ViT-B/16 pretrained on ImageNet-21K, 300 rounds x 10 local epochs, SGD lr
# 0.01, batch 32; FedIns M = 25, C = 3. The paper gives one accuracy per dataset (no
# per-domain DomainNet columns); '# Com.cost' as printed (SOLO's is '—', left out). The
# 'Federated SSF (Table 2: SSF)' row is Table 2's "SSF" ablation (its '#New.Param.' 0.00 M
# is inference overhead, not communication: left out). Left out: Table 1's "FedIns (w. SSF
# Pool)" row (82.34 / 84.11 / 86.29, 5.35 M) -- the text never defines it (Table 2's "SSF
# Pool (Ours)" equals "FedIns (Ours)"), so it is not mapped to our 'FedIns (SSF pool, batch
# query)'; Table 2's Prompt and Prompt Pool rows (no row of ours).
PAPER_NUMBERS = {
    # ViT-B/16 (IN-21K), feature shift: 6 clients, one DomainNet domain each, 26 images per client
    'Table 1 (DomainNet)': {
        'source': 'Table 1, DomainNet, accuracy %; Federated SSF row from Table 2 ("SSF"), DomainNet',
        'rows': {
            'SOLO': {'Test (all domains)': 62.18},
            'FedAvg (w.Full)': {'# Com.cost': '85.80 M', 'Test (all domains)': 80.02},
            'FedProx': {'# Com.cost': '85.80 M', 'Test (all domains)': 78.73},
            'SCAFFOLD': {'# Com.cost': '85.80 M', 'Test (all domains)': 80.31},
            'FedBN': {'# Com.cost': '85.76 M', 'Test (all domains)': 80.07},
            'MOON': {'# Com.cost': '85.80 M', 'Test (all domains)': 81.65},
            'FedDC': {'# Com.cost': '85.80 M', 'Test (all domains)': 79.92},
            'Federated SSF (Table 2: SSF)': {'Test (all domains)': 80.75},
            'FedIns': {'# Com.cost': '5.35 M', 'Test (all domains)': 83.12},
        },
    },
    # ViT-B/16 (IN-21K), label shift: Dirichlet split, 5 clients of 123/209/168/222/278 images
    'Table 1 (CIFAR-100)': {
        'source': 'Table 1, CIFAR-100, accuracy %; Federated SSF row from Table 2 ("SSF"), CIFAR-100',
        'rows': {
            'SOLO': {'Test (all domains)': 33.81},
            'FedAvg (w.Full)': {'# Com.cost': '85.80 M', 'Test (all domains)': 81.22},
            'FedProx': {'# Com.cost': '85.80 M', 'Test (all domains)': 81.56},
            'SCAFFOLD': {'# Com.cost': '85.80 M', 'Test (all domains)': 78.02},
            'FedBN': {'# Com.cost': '85.76 M', 'Test (all domains)': 81.24},
            'MOON': {'# Com.cost': '85.80 M', 'Test (all domains)': 81.92},
            'FedDC': {'# Com.cost': '85.80 M', 'Test (all domains)': 78.44},
            'Federated SSF (Table 2: SSF)': {'Test (all domains)': 83.81},
            'FedIns': {'# Com.cost': '5.35 M', 'Test (all domains)': 84.83},
        },
    },
    # ViT-B/16 (IN-21K), label shift: Dirichlet split, 5 clients of 322/360/343/466/509 images
    'Table 1 (Tiny-ImageNet)': {
        'source': 'Table 1, Tiny-ImageNet, accuracy %; Federated SSF row from Table 2 ("SSF"), Tiny-ImageNet',
        'rows': {
            'SOLO': {'Test (all domains)': 17.17},
            'FedAvg (w.Full)': {'# Com.cost': '85.80 M', 'Test (all domains)': 79.02},
            'FedProx': {'# Com.cost': '85.80 M', 'Test (all domains)': 79.57},
            'SCAFFOLD': {'# Com.cost': '85.80 M', 'Test (all domains)': 76.76},
            'FedBN': {'# Com.cost': '85.76 M', 'Test (all domains)': 79.82},
            'MOON': {'# Com.cost': '85.80 M', 'Test (all domains)': 81.38},
            'FedDC': {'# Com.cost': '85.80 M', 'Test (all domains)': 79.81},
            'Federated SSF (Table 2: SSF)': {'Test (all domains)': 84.32},
            'FedIns': {'# Com.cost': '5.35 M', 'Test (all domains)': 86.79},
        },
    },
}
# Orderings the paper claims, checked on our numbers: (better row, worse row, columns);
# columns () = every column both rows have. Accuracy column only ('# Com.cost' is a string;
# the per-domain columns of our table are not in the paper). Sec. 4.2: "our FedIns
# consistently outperform baselines in all settings"; Table 2: the SSF pool above one SSF;
# "the results of SOLO are lower than those of other FL algorithms".
CLAIMS = (
    ('FedIns', 'SOLO', ('Test (all domains)',)),
    ('FedIns', 'FedAvg (w.Full)', ('Test (all domains)',)),
    ('FedIns', 'FedProx', ('Test (all domains)',)),
    ('FedIns', 'SCAFFOLD', ('Test (all domains)',)),
    ('FedIns', 'FedBN', ('Test (all domains)',)),
    ('FedIns', 'MOON', ('Test (all domains)',)),
    ('FedIns', 'FedDC', ('Test (all domains)',)),
    ('FedIns', 'Federated SSF (Table 2: SSF)', ('Test (all domains)',)),
    ('FedAvg (w.Full)', 'SOLO', ('Test (all domains)',)),
)
