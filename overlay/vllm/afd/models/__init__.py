# SPDX-License-Identifier: Apache-2.0
"""Model pieces of AFD: which architectures split (``registry``), the attention
side's remote-FFN stand-in (``remote_ffn``), and the FFN side's FFN-only model
(``ffn_model``). Import the submodules directly: the model loader imports the
registry, and must not pull in model code while it loads."""
