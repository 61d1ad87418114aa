# SPDX-License-Identifier: Apache-2.0
"""Model pieces of AFD: which architectures split (``registry``, from the
shared builders in ``spec`` and the MoE families' routing in ``families``),
the attention side's remote-FFN stand-in (``remote_ffn``), and the FFN side's
FFN-only model (``ffn_model``, and ``afd_role_model_class``, which the model
loader asks which class to build). Import the submodules directly: the model
loader and the config's verification import one each, and must not pull in
the others."""
