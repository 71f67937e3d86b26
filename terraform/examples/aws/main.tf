# One g5/g6 Spot VM that trains, checkpoints to instance store NVMe on a termination notice and
# uploads to S3 before the 2-minute deadline; its replacement restores and resumes.
provider "aws" {
  region = var.region
}

module "fleet" {
  source = "../../modules/aws-spot-fleet"

  name           = "llm-finetune"
  ami_id         = var.ami_id
  instance_types = ["g5.2xlarge", "g6.2xlarge", "g5.4xlarge", "g6.4xlarge"]
  subnet_ids     = var.subnet_ids

  bucket_name       = var.bucket_name
  checkpoint_prefix = "runs/llm-finetune-1"

  # g5/g6 have instance store NVMe: checkpoints go there, fast, and spotguard uploads them.
  local_nvme_mount = "/mnt/nvme"
  checkpoint_dir   = "/mnt/nvme/spotguard"

  trainer_user    = "ubuntu"
  trainer_command = "/opt/conda/bin/python /home/ubuntu/train.py --config /home/ubuntu/run.yaml"
  trainer_environment = {
    HF_HOME = "/mnt/nvme/hf"
  }
  extra_config = "on_rebalance = \"checkpoint\""

  # The peer tier, once the job's token is in Secrets Manager (and more than one VM runs).
  enable_peers          = var.peer_token_secret_arn != null
  peer_token_secret_arn = var.peer_token_secret_arn

  additional_policy_arns = ["arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"]

  tags = {
    project = "llm-finetune"
  }
}
