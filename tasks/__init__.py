"""Flyte tasks: each holds the Flyte concerns (resources, retries, cache, plugins) and calls traincore.

    plan       check every launch input before anything runs; build the Config and Topology
    stage      stage_dataset (cached per DataConfig and source fingerprint)
    train      the torch-elastic train task; launch picks local / Kubernetes / Slurm at launch time
    launch     which train task a launch gets, and how a pod or Slurm job rebuilds it
    export     the latest complete checkpoint -> safetensors + lineage
    evaluate   the test split, the evaluation Deck
    promote    champion vs challenger, publish to the registry
    types      the typed values that cross task boundaries
    resources  the requests a launch sets per node (the workflow input ``resources``)
    storage                local views of FlyteDirectory inputs; the durable checkpoint root as a Store
    decks, report          the HTML of our Decks
    rendezvous, backends   a failed rendezvous, explained; the backend names
    errors                 errors for the user to fix, which pyflyte run shows as their message alone
    image_spec             the ImageSpec twin of dockerfiles/cpu.Dockerfile
    slurm/                 the Slurm backend (connector, job script, client, SSH, states)
"""
