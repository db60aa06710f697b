"""pd-operator control plane: API, rendering, reconciliation and the pdctl CLI."""
