"""Training impact (issue 46): small reference models trained with one build's optimizer.

    data.py    the fixed datasets (a seeded token stream, a seeded teacher's labels) and each
               seed's data order
    models.py  the models as functions of their parameter tensors (an MLP, a tiny decoder-only
               transformer) with each tensor's shape, param group and initialisation
    loop.py    one training run through a family adapter's group lifecycle (the library's own
               optimizer over every tensor, as a training loop uses it); what a kernel host's
               "train" request runs
    stats.py   paired seeds and the two controls turned into a verdict

The service's side (the configurations, the answers, the verdicts' words) is service/core/training.py.
"""
