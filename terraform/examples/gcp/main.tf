# One g2 (L4) Spot VM that trains, checkpoints to Local SSD on a preemption notice and uploads
# to GCS within the ~30 s notice; the group recreates the VM, which restores and resumes.
provider "google" {
  project = var.project_id
  region  = var.region
}

module "fleet" {
  source = "../../modules/gcp-spot-fleet"

  name         = "llm-finetune"
  project_id   = var.project_id
  region       = var.region
  zones        = var.zones
  machine_type = "g2-standard-8"
  source_image = "projects/deeplearning-platform-release/global/images/family/common-cu124-ubuntu-2204-py310"
  subnetwork   = var.subnetwork

  local_ssd_count  = 1
  local_nvme_mount = "/mnt/nvme"
  checkpoint_dir   = "/mnt/nvme/spotguard"

  bucket_name       = var.bucket_name
  bucket_location   = upper(var.region)
  checkpoint_prefix = "runs/llm-finetune-1"

  # The peer tier, once the job's token is in Secret Manager (and more than one VM runs).
  enable_peers      = var.peer_token_secret != null
  peer_token_secret = var.peer_token_secret

  trainer_user    = "trainer"
  trainer_command = "/opt/conda/bin/python /home/trainer/train.py --config /home/trainer/run.yaml"

  labels = {
    project = "llm-finetune"
  }
}
