"""The references a kernel is measured against (float64 and same-precision).

    optimizers.py        torch.optim where it has the algorithm, paper implementations where not
    blockwise8.py        the quantization-aware 8-bit references
    quant_map.py         the dynamic quantization map
    closed_form_8bit.py  one 8-bit step from a zero state, in closed form
    digest.py            what each optimizer's references are made of, digested (reference drift)
"""
