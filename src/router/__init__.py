"""Several slotserve replicas behind one prefix-aware router (`slotserve route`)."""
