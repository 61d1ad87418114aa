# SPDX-License-Identifier: Apache-2.0
"""What AFD processes need of the machine they run on: OpenMP thread binding
on CPUs, NVIDIA MPS for processes that share a GPU."""
