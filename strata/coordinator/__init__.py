"""The coordinator process: which request sits in which slot, what each window carries, what
its results commit. Its rooms import downwards, api/ -> engine/ -> speculation/, stages/ ->
the nouns they share, which sit here (config, sampling_params, sequence, slots, windows,
grammar). This line is the rule for those nouns and the most any room may import outside:
May import: protocol, model, trace, config_error"""
